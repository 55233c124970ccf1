"""The store's core: ``FeatureCache`` (``cache``) and what it is made of: the tier chain as data
(``chain``), the read path (``lookup``), what a put hands the tiers (``intake``: the checked key,
its metadata, the tensor kept), the counters (``counts``), copies between devices (``copier``),
pinned host memory (``hostpool``), the only threads (``demoter``, ``writer``), leases, fork
handling and one computation per key (``lease``, ``forks``, ``singleflight``). It imports the
foundation (keys, config, codec, eviction, tiers, store) and never lmdeploy, the integration, the
server or the CLI (``.importlinter``)."""
