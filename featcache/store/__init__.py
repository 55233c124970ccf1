"""The LMDB store under the disk tier: one home for its format and its files.

- ``layout``: the tables, the bytes of every record, the format tag, the key limits;
- ``books``: the records a write transaction changes together (data, meta, lru, ``used_bytes``);
- ``files``: the checks of a store directory and its files, and who has them open;
- ``lmdbcheck``: the walk of ``data.mdb``'s B-trees before LMDB reads a page;
- ``env``: opening a store for the disk tier, and the gate around its environment;
- ``handle``: the disk tier's environment across ``close`` and ``fork()`` (``StoreHandle``);
- ``deletes``: deleting entries from outside a cache (the store tools' one writer), no torch.

The disk tier (``featcache.tiers.disk``) and the store tools (``featcache.storetools``) import
these; nothing here imports a tier or a tool.
"""
