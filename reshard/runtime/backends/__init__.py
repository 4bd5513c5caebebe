"""The backends: how bytes move between devices. ``communicator`` (the ``Backend`` and
``Communicator`` contracts), ``registry`` (backends by name), ``gloo`` (CPU devices), ``nccl``
(GPU devices, a package that loads cupy only when a mesh asks for it) and ``cuda_buffers`` (CUDA
memory as cupy and torch see it).

They know neither side of the runtime: a backend is given groups and buffers, and moves bytes."""
