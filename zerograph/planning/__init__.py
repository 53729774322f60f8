"""Planning before running: ``zerograph.plan``'s memory and communication figures, the activations
it predicts, and the memory budget ``MemoryPolicy(budget_bytes=...)`` fits the schedule to."""
