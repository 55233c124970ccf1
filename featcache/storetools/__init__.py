"""The store tools behind the `featcache` store commands, apart by what they do to a store:

- ``view``: ``StoreView``, a read-only view of a store directory, live or not (never writes);
- ``maintenance``: the writes: deleting entries through the disk tier (``verify --fix``,
  ``purge``), deleting the files of a store of another format (``purge --all``), ``compact``;
- ``report``: the typed records they hand back (``EntryInfo``, ``Summary``, ``VerifyReport``).

The layout of the store is ``featcache.store``'s; these modules read and write it only through
``featcache.store`` and the disk tier, and decode no record themselves.
"""
