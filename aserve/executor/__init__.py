"""aserve.executor: how the engine reaches its ranks.

    factory.make_executor(spec, layout)   one rank: `UniProcExecutor` (rank 0 in this process)
                                          several:  `MultiprocExecutor` (rank 0 here, this
                                          node's other ranks spawned, other nodes' started there)
    multiproc.run_worker_node(spec, layout, node_rank)   a node > 0: its ranks, until node 0 stops
    spec        `WorkerSpec`, `RankLayout`: what the executors are built from (no torch)
    messages    the rank protocol: frozen dataclasses rank 0 sends, dispatched by type

Both executors build every rank's `Worker` from the same `WorkerSpec`. This package's
`__init__` imports nothing, so that `spec` stays importable without torch.
"""
