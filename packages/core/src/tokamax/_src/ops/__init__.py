"""The ops, one folder each: ``api`` (signature, validation, canonical args and
the `OpDefinition` generic code reads), ``sharding`` (the partitioning rule),
``xla`` (the XLA reference implementations as `Op`s), ``problems`` (benchmark
shapes), and the op's building blocks (attention's ``ring``, ragged_dot's
``moe``). Backends implement an op in their own file for it."""
