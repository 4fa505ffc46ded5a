"""The reduction operations as Horovod names them: constants only, so that naming one
(``hvd.Average``) before ``init()`` does not start MPI. Their values are the library's op names."""

Average, Sum, Min, Max, Product = "mean", "sum", "min", "max", "prod"
#: Horovod's Adasum; not implemented here: passing it raises ``ValueError``.
Adasum = "adasum"
