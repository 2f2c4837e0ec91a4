"""Feature transport: target hidden states from an engine into the trainer (docs/STREAM.md).

- ``feature_stream``: the trainer's one interface, ``open_feature_stream`` (``inprocess`` or ``colocated``)
- ``engine_process``: the co-located engine process that runs the target ahead of the trainer
- ``feature_ring``: the shared slots (CUDA IPC / shared memory) the engine writes and the trainer reads
"""
