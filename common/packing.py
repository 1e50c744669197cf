"""Packing for the fine-tuning template: whole examples concatenated into rows of up to `max_length` tokens,
so no compute goes to padding, and no example attends to another.

transformers builds a block-diagonal causal mask from position ids that restart at each example, when the
forward gets no attention mask and builds no cache (`masking_utils.find_packed_sequence_indices`, used by the
SDPA, eager and flex masks; flash attention reads the position ids itself). So a packed batch is input ids,
position ids and labels only, and the forward is called with `use_cache=False`. Each example's first label is
IGNORE, so the last token of one example never learns to predict the first of the next; a row shorter than the
batch's longest is padded with one more segment of its own (positions from 0, labels IGNORE), which the real
tokens never see.
"""

from __future__ import annotations

import bisect

import torch
from torch.utils.data import Dataset

IGNORE = -100  # label of a token that is not learned (torch's cross-entropy ignore_index)
# Attention whose mask transformers builds from restarting position ids (flash attention: from the ids directly)
PACKABLE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
PACKABLE_LAYERS = ("full_attention", "sliding_attention")


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of examples grouped into rows of at most `capacity` tokens, best fit decreasing: the longest
    example first, each into the fullest row it fits in. Deterministic (ties by index); rows keep their
    examples in index order. Few rows stay part-empty: on mixed lengths they fill ~95%+."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row number), sorted: the fullest row that fits is the first >=
    for index in order:
        length = lengths[index]
        if length > capacity:
            raise ValueError(f"example {index} has {length} tokens, more than a row's {capacity}")
        spot = bisect.bisect_left(free, (length, -1))
        if spot == len(free):
            rows.append([index])
            room, row = capacity - length, len(rows) - 1
        else:
            room, row = free.pop(spot)
            rows[row].append(index)
            room -= length
        if room > 0:
            bisect.insort(free, (room, row))
    return [sorted(row) for row in rows]


class PackedExamples(Dataset):
    """Rows of (input_ids, labels) examples: packed into `capacity` tokens a row, or one example a row (None)."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], capacity: int | None = None):
        self.examples = examples
        groups = pack([len(ids) for ids, _ in examples], capacity) if capacity else [[i] for i in range(len(examples))]
        self.rows = groups

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[tuple[list[int], list[int]]]:
        return [self.examples[i] for i in self.rows[index]]

    def filled(self, capacity: int) -> float:
        """The share of the rows' tokens that are examples' (the rest would be padding)."""
        return sum(len(ids) for ids, _ in self.examples) / max(1, capacity * len(self.rows))


class PackedCollate:
    """Collate rows of examples: input ids, position ids restarting at each example, labels with IGNORE at each
    example's first token, rows padded to the longest by a segment of their own; no attention mask. `tokens`
    counts the examples' tokens (padding excluded), for the throughput."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[list[tuple[list[int], list[int]]]]) -> dict[str, torch.Tensor]:
        input_ids, position_ids, labels = [], [], []
        for row in rows:
            ids, positions, targets = [], [], []
            for example_ids, example_labels in row:
                ids += example_ids
                positions += range(len(example_ids))
                targets += [IGNORE] + list(example_labels[1:])
            input_ids.append(ids)
            position_ids.append(positions)
            labels.append(targets)
        longest = max(len(ids) for ids in input_ids)
        tokens = sum(len(ids) for ids in input_ids)
        for ids, positions, targets in zip(input_ids, position_ids, labels):
            pad = longest - len(ids)
            ids += [self.pad_id] * pad
            positions += range(pad)
            targets += [IGNORE] * pad
        return {"input_ids": torch.tensor(input_ids), "position_ids": torch.tensor(position_ids),
                "labels": torch.tensor(labels), "tokens": torch.tensor(tokens)}


def unpackable(config) -> str | None:
    """Why a model with this config cannot train on packed rows without examples mixing, or None."""
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in PACKABLE_ATTENTION:
        return (f"its attention implementation {attention!r} does not keep packed examples apart (supported: "
                f"{', '.join(PACKABLE_ATTENTION)})")
    others = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind not in PACKABLE_LAYERS})
    if others:
        return (f"its {', '.join(others)} layers would mix packed examples (they need per-example kernels); "
                f"train it without --packing")
    return None
