"""Write a tiny Llama-architecture causal LM and its tokenizer to a folder, offline (no download).

    python scripts/make_tiny_model.py runs/tiny-llama            # ~1 s; then --model runs/tiny-llama
    python scripts/make_tiny_model.py runs/tiny-llama --data runs/reverse.jsonl   # also a demo task

The weights are random and the tokenizer is a byte-level BPE trained on the spot with `tokenizers`
(any text encodes, nothing maps to <unk>), with a ChatML chat template, saved with `save_pretrained`
so `AutoModelForCausalLM` and `AutoTokenizer` load the folder like a model from the Hub. It is what
the tests and the offline demo fine-tune; a real model is the same command with `--model <hub id>`.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's way (its stock template, shortened): the reasoning of assistant turns before the last user message is
# dropped (history rewritten), the last turn always shows a <think> block, empty if it has no reasoning; and, as
# Gemma's and Mistral's templates do, a role it does not know is refused.
QWEN3_STYLE_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' or message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- raise_exception('Unexpected message role: ' + message.role) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "qwen3": QWEN3_STYLE_CHAT_TEMPLATE}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def reverse_task(count: int, seed: int = 0, chat: bool = False) -> list[dict]:
    """A task whose answer depends on the prompt: reverse a short random word of letters."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_lowercase[:8]) for _ in range(rng.randint(3, 6)))
        if chat:
            examples.append({"messages": [{"role": "system", "content": "You reverse words."},
                                          {"role": "user", "content": word},
                                          {"role": "assistant", "content": word[::-1]}]})
        else:
            examples.append({"prompt": f"reverse {word} =", "completion": f" {word[::-1]}"})
    return examples


def train_tokenizer(vocab_size: int, chat_template: str = "chatml"):
    """A byte-level BPE tokenizer (transformers' PreTrainedTokenizerFast) trained on a few synthetic lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [f"reverse {e['prompt'].split()[1]} = {e['completion']}" for e in reverse_task(2000)]
    corpus += ["system user assistant You reverse words. The quick brown fox jumps over the lazy dog."] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=CHAT_TEMPLATES[chat_template])


def make_tiny_model(folder: str | Path, *, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                    vocab_size: int = 384, tie_word_embeddings: bool = True, seed: int = 0,
                    initializer_range: float = 0.2, chat_template: str = "chatml") -> Path:
    """Write the model (safetensors, fp32) and tokenizer to `folder`; returns it.

    `initializer_range` is 10x Llama's: with 0.02 a random tied embedding gives near-zero logits that only
    training the embedding can change, so LoRA (which leaves it frozen) could not learn anything in a test.
    `chat_template`: "chatml" (only appends) or "qwen3" (rewrites earlier turns, QWEN3_STYLE_CHAT_TEMPLATE).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = train_tokenizer(vocab_size, chat_template)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=256, tie_word_embeddings=tie_word_embeddings,
                         initializer_range=initializer_range,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Sampling defaults and an extra stop id, as a real chat model's generation_config.json has: an export must
    # keep them (a config rebuilt from the model's config would not)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.update(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    model.generation_config._from_model_config = False  # its own file, as a released model's
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="where to write the model and tokenizer")
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chat_template", choices=sorted(CHAT_TEMPLATES), default="chatml",
                        help="chatml: only appends; qwen3: drops the reasoning of earlier turns, as Qwen3's does")
    parser.add_argument("--data", help="also write a JSONL file of the reverse-a-word task here")
    parser.add_argument("--examples", type=int, default=600, help="examples in --data")
    parser.add_argument("--chat", action="store_true", help="--data as chat `messages` instead of prompt/completion")
    args = parser.parse_args()
    folder = make_tiny_model(args.folder, hidden_size=args.hidden_size, layers=args.layers,
                             chat_template=args.chat_template)
    print(f"wrote a tiny Llama-architecture model and its tokenizer to {folder}")
    if args.data:
        Path(args.data).parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(example) for example in reverse_task(args.examples, chat=args.chat)]
        Path(args.data).write_text("\n".join(lines) + "\n")
        print(f"wrote {len(lines)} examples of the reverse-a-word task to {args.data}")


if __name__ == "__main__":
    main()
