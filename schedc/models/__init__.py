"""Small models for examples and tests, bound to specs by `model.source`.

Each module exposes ``build() -> (layers, loss_fn)`` (seeded, so every rank
builds the same initial weights) and ``batch(iteration, dp, microbatch) ->
(input, target)`` (deterministic, so a re-routed microbatch sees the data its
own pipeline would have seen).

- `schedc.models.mlp`: a few Linear+ReLU blocks and a linear head, MSE loss.
- `schedc.models.gpt`: a tiny GPT-style decoder (embedding, transformer
  blocks, head), cross-entropy loss; runs on a CPU in milliseconds.
"""
