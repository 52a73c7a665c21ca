"""The compiler: a training loop becomes a fragmented dataflow graph (trace -> IR -> printer / image)."""
