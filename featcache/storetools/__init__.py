"""The store tools behind the `featcache` store commands, apart by what they do to a store:

- ``view``: ``StoreView``, a read-only view of a store directory, live or not (never writes);
- ``maintenance``: the writes: deleting entries (``verify --fix``, ``purge``; through
  ``store.deletes``, by the disk tier's rules), deleting the files of a store of another format
  (``purge --all``), ``compact``.

The typed records they hand back are ``featcache.store.report``'s (``EntryInfo``, ``Summary``,
``VerifyReport``). The layout of the store is ``featcache.store``'s; these modules read and write
it only through ``featcache.store``, decode no record themselves, and import no torch (the store
commands start in a fraction of a second).
"""
