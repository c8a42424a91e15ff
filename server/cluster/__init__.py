"""Cluster mode: the service's engine batches on the GPU workers of a Dask cluster.

``pyhf-gpu-server --dask-scheduler tcp://HOST:8786`` keeps the HTTP API, the job store and the
batching scheduler on the API node and hands each batch to a Dask worker
(:class:`~.runner.ClusterRunner`, the scheduler's runner); workers are ``pyhf-gpu-worker``
processes (:mod:`.worker`), or any ``dask worker --resources GPU=1 --preload
pyhf_gpu_server.cluster.worker``, each holding warm models in a worker plugin
(:mod:`.plugin`). A batch goes to the worker that holds its model (:mod:`.placement`) and
carries the model's recipe only where that worker lacks it (:mod:`.tasks`).

Nothing here is imported without ``--dask-scheduler``.
"""
