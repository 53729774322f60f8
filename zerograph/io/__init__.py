"""Weights in and out of the shards: initialisation, state dicts and safetensors files, and the
checkpoint's agreement across ranks and its safe unpickling (``zerograph.checkpoint`` is the face)."""
