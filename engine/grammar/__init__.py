"""Grammar-constrained decoding: a model's token grammar compiler and each request's matcher."""
