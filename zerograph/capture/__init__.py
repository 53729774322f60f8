"""Capture: the torch.compile backend (Dynamo graph, AOTAutograd joint graph, passes, lowering), the
checks and set-up before it, and the compiled model's forward through the captured graphs."""
