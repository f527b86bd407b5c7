"""Small built-in models for the demo, the tests and the benchmarks (torch only)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BasicBlock", "ResNetLike", "resnet34_like", "tiny_cnn", "TransformerEncoderLike",
           "tiny_transformer", "MLP", "DEMO_MODELS"]


class BasicBlock(nn.Module):
    """The ResNet basic block: conv-bn-relu-conv-bn plus a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetLike(nn.Module):
    """torchvision's ResNet layout (stem, four stages of basic blocks, pooled fc), any width."""

    def __init__(self, layers: Sequence[int] = (3, 4, 6, 3), width: int = 64, num_classes: int = 10,
                 in_channels: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        for i, n in enumerate(layers):
            cout = width * 2 ** i
            blocks = [BasicBlock(cin if j == 0 else cout, cout, (1 if i == 0 else 2) if j == 0 else 1)
                      for j in range(n)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = cout
        self.n_stages = len(layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.n_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet34_like(width: int = 8, num_classes: int = 10) -> ResNetLike:
    """ResNet-34's layout (36 Conv2d layers with the shortcuts) at a small width."""
    return ResNetLike((3, 4, 6, 3), width=width, num_classes=num_classes)


def tiny_cnn(width: int = 16, num_classes: int = 10) -> ResNetLike:
    """A small ResNet (one block per stage): the CLI's demo CNN, input 3xHxW."""
    return ResNetLike((1, 1, 1, 1), width=width, num_classes=num_classes)


class EncoderLayer(nn.Module):
    """A BERT-style post-norm encoder layer; ``sdpa=False`` computes attention eagerly."""

    def __init__(self, dim: int, heads: int, ff: int, sdpa: bool = True, dropout: float = 0.0):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, ff)
        self.act = nn.GELU()
        self.ff2 = nn.Linear(ff, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def attention(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = (p(x).view(b, t, h, d // h).transpose(1, 2) for p in (self.query, self.key, self.value))
        if self.sdpa:
            ctx = F.scaled_dot_product_attention(q, k, v)
        else:
            att = torch.softmax(q @ k.transpose(-2, -1) / (d // h) ** 0.5, dim=-1)
            ctx = att @ v
        return self.out(ctx.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = self.norm1(x + self.dropout(self.attention(x)))
        return self.norm2(x + self.dropout(self.ff2(self.act(self.ff1(x)))))


class TransformerEncoderLike(nn.Module):
    """Token embedding, ``depth`` encoder layers, a classifier head on the mean token."""

    def __init__(self, vocab: int = 1000, dim: int = 64, heads: int = 4, depth: int = 2,
                 ff: int = 256, num_classes: int = 10, sdpa: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, ff, sdpa) for _ in range(depth))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens):
        x = self.embed(tokens) if tokens.dtype in (torch.int32, torch.int64) else tokens
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def tiny_transformer(dim: int = 64, depth: int = 2, sdpa: bool = True) -> TransformerEncoderLike:
    """The CLI's demo transformer: takes int64 tokens (B x T) or float embeddings (B x T x dim)."""
    return TransformerEncoderLike(dim=dim, depth=depth, heads=4, ff=4 * dim, sdpa=sdpa)


class MLP(nn.Module):
    """Two hidden layers; ``fc2`` is called twice per forward (a module seen twice)."""

    def __init__(self, dim: int = 32, hidden: int = 64, out: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


# name -> (factory, example input shape, input dtype)
DEMO_MODELS = {
    "cnn": (tiny_cnn, (8, 3, 64, 64), torch.float32),
    "resnet34": (resnet34_like, (2, 3, 64, 64), torch.float32),
    "transformer": (tiny_transformer, (8, 32), torch.int64),
    "mlp": (MLP, (16, 32), torch.float32),
}
