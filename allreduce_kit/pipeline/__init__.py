"""Pipeline (model) parallelism: schedules as data (``schedules``), the runtime that executes a
rank's list (``runtime``), the S x D grid (``grid``), the MLP cut into stages (``stage``) and the
trainer that combines them with data parallelism (``train``). docs/pipeline.md.

Importing it imports nothing heavy: ``schedules`` and ``grid`` are pure Python.
"""
