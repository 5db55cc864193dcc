"""What a TRACE rollout records so that the trainer rounds as it did, and where the records travel.

Holds the record kinds behind one protocol (:mod:`~.record`: ``SiteRecord``): the paper's hints
(:mod:`~.hints`: ``full``/``lsb``, ``encode_hint``, ``guided_quantize``), the compact records and
guidance modes (:mod:`~.compact`: ``GuidedMode``, ``GuidanceSpec``, ``CompactRecord``) over the
generic codecs of :mod:`~.coding`, what a decode could not recover (:mod:`~.report`) and the
record names (:mod:`~.names`); and the store the records cross processes and machines in
(:mod:`~.store`: ``StoreWriter``, ``seal_step``, ``StoreReader``). Imports ``formats`` (the codes
and grids a record describes) and ``files``; no engine: imported by ``engines``, ``rl``,
``reports``, ``integrations``, ``cli`` and the package's top level.
"""
