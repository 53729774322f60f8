"""Unit templates: one block kind traced, partitioned and lowered once, called by every unit of the
kind (``kinds``), with the cache, keys, watch and trace steps around it."""
