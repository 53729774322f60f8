"""Sharding a model: which modules become units, their shard layouts and flat buffers, the module
surgery, and the checks on parameters the captured graphs cannot follow."""
