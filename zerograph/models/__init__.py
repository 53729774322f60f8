"""Models shipped with zerograph for its examples, tests and benchmarks (importable as
``zerograph.models.gpt``); nothing in the library depends on them."""
