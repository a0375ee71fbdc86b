"""trio-infer: an Open Inference Protocol model server built on Trio's structured concurrency."""
