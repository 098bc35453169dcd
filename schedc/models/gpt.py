"""A GPT-style decoder: embedding, transformer blocks, head; next-token loss on synthetic tokens.

Called with no arguments (a spec without a `model` block), it is tiny, to
train on a CPU in milliseconds: ``[Embedding, Block x 4, Head]``, 6 layers.
Called by schedc for a spec whose `model` block gives ``layers``,
``hidden``, ``heads``, ``seq_len`` and ``vocab``, it is that model, and its
list has exactly ``layers`` entries, counted as the cost model counts them:
the embedding runs in the first entry and the head in the last, so a
`partition` slices the same layers for the cost model, `schedc profile` and
the generated programs. `batch` likewise takes ``seq_len``, ``vocab`` and
``microbatch_size`` from the block.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64
SEQ_LEN = 16
D_MODEL = 32
N_HEAD = 2
N_LAYER = 4
MICROBATCH_SIZE = 2
SEED = 0


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, seq_len: int, d_model: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        # No bias: the key bias has an analytically zero gradient (softmax ignores a constant
        # per row), so its gradient is pure rounding noise, which Adam would amplify to ~lr.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final layer norm and the vocabulary projection."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.lm = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


class NextTokenLoss(nn.Module):
    """Cross-entropy of logits (b, t, vocab) against targets (b, t)."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build(n_layer: int = N_LAYER, d_model: int = D_MODEL, n_head: int = N_HEAD,
          vocab: int = VOCAB, seq_len: int = SEQ_LEN, *, layers: int | None = None,
          hidden: int | None = None, heads: int | None = None) -> tuple[nn.Sequential, nn.Module]:
    """The layers and the next-token loss; seeds itself. Without `layers`:
    ``[Embedding, Block x n_layer, Head]``. With `layers` (a spec's model block): `layers`
    entries, the first holding the embedding, the last the head (see the module's doc)."""
    d_model = hidden or d_model
    n_head = heads or n_head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        if layers is None:
            parts = [Embedding(vocab, seq_len, d_model)]
            parts += [Block(d_model, n_head) for _ in range(n_layer)]
            parts.append(Head(d_model, vocab))
        else:
            parts = [Block(d_model, n_head) for _ in range(layers)]
            parts[0] = nn.Sequential(Embedding(vocab, seq_len, d_model), parts[0])
            parts[-1] = nn.Sequential(parts[-1], Head(d_model, vocab))
    return nn.Sequential(*parts), NextTokenLoss()


def batch(iteration: int, dp: int, microbatch: int, *, seq_len: int = SEQ_LEN, vocab: int = VOCAB,
          microbatch_size: int = MICROBATCH_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens for (iteration, dp, microbatch); the target is the input shifted by one."""
    g = torch.Generator().manual_seed(1 + (iteration << 40) + (dp << 20) + microbatch)
    tokens = torch.randint(0, vocab, (microbatch_size, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
