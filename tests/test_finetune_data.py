"""templates/finetune_causal_lm.py, its data: every kind of source (JSONL, JSON, parquet, CSV, a folder of data
files with its own validation split, a `save_to_disk` folder, a Hub id served from the `datasets` cache offline)
built on the spot and read the same way; chat templates that rewrite earlier turns (a Qwen3-style one) learn each
assistant turn, and only those, in the context the model sees when it writes it; bad rows and refused chats are one
error line. Real launches: a Hub id with the Qwen3-style template on 1 process, `save_to_disk` and JSON sources on 2
ranks; an exact resume on parquet, in-process."""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, clean_env, launch, load_template, start_clean_accelerate
from test_finetune import learned

sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_model import QWEN3_STYLE_CHAT_TEMPLATE, reverse_task  # noqa: E402

TEMPLATE = REPO / "templates" / "finetune_causal_lm.py"
HUB_ID = "someone/reverse-words"  # served from a local `datasets` cache, offline


def ft():
    return load_template("finetune_causal_lm")


def multi_turn_chats(count: int, seed: int = 0, reasoning_every: int = 3) -> list[dict]:
    """Two reverse-a-word turns per chat; every `reasoning_every`-th chat's first answer holds a <think> block."""
    first, second = reverse_task(count, seed), reverse_task(count, seed + 1)
    chats = []
    for number, (a, b) in enumerate(zip(first, second)):
        word_a, word_b = a["prompt"].split()[1], b["prompt"].split()[1]
        answer_a = (f"<think>\nreverse {word_a}\n</think>\n\n" if number % reasoning_every == 0 else "") + word_a[::-1]
        chats.append({"messages": [
            {"role": "system", "content": "You reverse words."}, {"role": "user", "content": word_a},
            {"role": "assistant", "content": answer_a}, {"role": "user", "content": word_b},
            {"role": "assistant", "content": word_b[::-1]}]})
    return chats


@pytest.fixture(scope="module")
def qwen3_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with a Qwen3-style chat template (earlier turns' reasoning dropped, unknown roles refused)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen3_style") / "tiny"
    shutil.copytree(tiny_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = QWEN3_STYLE_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizers(tiny_model, qwen3_model):
    from transformers import AutoTokenizer

    return {"chatml": AutoTokenizer.from_pretrained(tiny_model), "qwen3": AutoTokenizer.from_pretrained(qwen3_model)}


def hub_cache(cache: Path, repo_id: str, splits: dict[str, list[dict]]) -> Path:
    """A `datasets` cache holding `repo_id` as a Hub download leaves it (<cache>/<owner>___<name>/<config>/<version>/
    <hash>/<name>-<split>.arrow), built offline from parquet files: with HF_HUB_OFFLINE=1, load_dataset(repo_id)
    takes it from there."""
    import datasets

    files = cache.parent / "hub_files"
    files.mkdir(parents=True, exist_ok=True)
    for split, records in splits.items():
        datasets.Dataset.from_list(records).to_parquet(str(files / f"{split}.parquet"))
    datasets.load_dataset("parquet", data_dir=str(files), cache_dir=str(cache / "build"))
    built = next(p for p in (cache / "build" / "parquet").glob("default-*/*/*") if p.is_dir())
    owner, name = repo_id.split("/")
    target = cache / f"{owner}___{name}" / "default" / built.parent.name / built.name
    shutil.copytree(built, target)
    for arrow in target.glob("parquet-*.arrow"):
        arrow.rename(target / arrow.name.replace("parquet-", f"{name}-"))
    shutil.rmtree(cache / "build")
    return cache


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """Point `datasets` (already imported or not) at a cache of its own, offline."""
    import datasets

    cache = tmp_path / "datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


# --------------------------------------------------------------------------------------- chat templates
def test_qwen3_style_chat_learns_each_assistant_turn_in_the_context_it_is_written_in(tokenizers):
    tokenizer = tokenizers["qwen3"]
    render = lambda messages, prompt=False: tokenizer.apply_chat_template(  # noqa: E731
        messages, tokenize=False, add_generation_prompt=prompt)
    plain, thinking = multi_turn_chats(2, reasoning_every=2)[1]["messages"], multi_turn_chats(1)[0]["messages"]
    assert not render(plain[:5]).startswith(render(plain[:3]))  # the template rewrites history: the old refusal

    # no reasoning in the data: one example, the template's rendering less the empty <think> block of the last turn
    [(ids, labels)] = ft().encode_chat(tokenizer, plain)
    assert learned(tokenizer, ids, labels) == [f"{plain[k]['content']}<|im_end|>\n" for k in (2, 4)]
    assert "<think>" not in tokenizer.decode(ids)
    assert tokenizer.decode(ids) == render(plain[:4], prompt=True) + f"{plain[4]['content']}<|im_end|>\n"
    # reasoning in the first answer: learned there, and gone from the second turn's context, as at generation time
    first, second = ft().encode_chat(tokenizer, thinking)
    assert learned(tokenizer, *first) == [f"{thinking[2]['content']}<|im_end|>\n"]
    assert tokenizer.decode(first[0]) == render(thinking[:3])
    assert learned(tokenizer, *second) == [f"{thinking[4]['content']}<|im_end|>\n"]
    assert tokenizer.decode(second[0]) == render(thinking[:4], prompt=True) + f"{thinking[4]['content']}<|im_end|>\n"
    assert "<think>" not in tokenizer.decode(second[0])
    # a one-turn chat learns the answer and its end of turn right after the generation prompt, no empty block
    [(ids, labels)] = ft().encode_chat(tokenizer, plain[:3])
    assert learned(tokenizer, ids, labels) == [f"{plain[2]['content']}<|im_end|>\n"]
    assert tokenizer.decode(ids) == render(plain[:2], prompt=True) + f"{plain[2]['content']}<|im_end|>\n"


def test_trl_conversational_prompt_completion_learns_the_completion_only(tokenizers):
    tokenizer = tokenizers["chatml"]
    chat = multi_turn_chats(1, reasoning_every=2)[0]["messages"]
    record = {"prompt": chat[:4], "completion": chat[4:]}
    [(ids, labels)], kind = ft().encode_record(record, tokenizer, 512)
    assert kind == "chat" and learned(tokenizer, ids, labels) == [f"{chat[4]['content']}<|im_end|>\n"]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(chat, tokenize=False)


def test_a_template_whose_generation_prompt_is_not_where_the_turn_starts_is_refused_saying_why(tokenizers):
    """DeepSeek-R1's template opens <think> in the generation prompt but renders answers without it."""
    tokenizer = tokenizers["chatml"]
    saved = tokenizer.chat_template
    tokenizer.chat_template = saved.replace("<|im_start|>assistant\n{% endif %}",
                                            "<|im_start|>assistant\n<think>\n{% endif %}")
    assert tokenizer.chat_template != saved
    try:
        with pytest.raises(ft().UsageError, match=r"^message 3: the chat template of --model renders this assistant "
                                                   r"message without the generation prompt it puts before it "
                                                   r".*cannot be told from their context$"):
            ft().encode_chat(tokenizer, multi_turn_chats(2, reasoning_every=2)[1]["messages"])
    finally:
        tokenizer.chat_template = saved


# -------------------------------------------------------------------------------------------- sources
def write_sources(root: Path, records: list[dict]) -> dict[str, Path]:
    """The same records as every kind of file the template reads, and a folder of JSONL files."""
    import datasets

    table = datasets.Dataset.from_list(records)
    sources = {"jsonl": root / "data.jsonl", "json": root / "data.json", "parquet": root / "data.parquet",
               "csv": root / "data.csv", "save_to_disk": root / "saved", "folder": root / "folder"}
    sources["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    sources["json"].write_text(json.dumps(records))  # one JSON array
    table.to_parquet(str(sources["parquet"]))
    table.to_csv(str(sources["csv"]), index=False)
    table.save_to_disk(str(sources["save_to_disk"]))
    sources["folder"].mkdir()
    for part in range(2):  # split names come from file names: these are both training data
        (sources["folder"] / f"part{part}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records[part::2]))
    return sources


def test_every_kind_of_file_gives_the_same_examples_and_the_same_stable_split(tmp_path, tokenizers, offline_hub):
    tokenizer = tokenizers["chatml"]
    sources = write_sources(tmp_path, reverse_task(120))
    loaded = {kind: ft().load_examples(ft().Config(data_path=str(path), val_fraction=0.2), tokenizer)
              for kind, path in sources.items()}
    as_lists = lambda examples: sorted((e.input_ids, e.labels) for e in examples)  # noqa: E731
    for kind, (train, val, data_kind) in loaded.items():
        assert data_kind == "completion" and 10 <= len(val) <= 40 and len(train) + len(val) == 120, kind
        assert as_lists(train) == as_lists(loaded["jsonl"][0]), kind
        assert as_lists(val) == as_lists(loaded["jsonl"][1]), kind
    assert not list((tmp_path / "saved").glob("cache-*"))  # nothing written into the user's dataset folder


def held_out(path: Path, tokenizer) -> list:
    """The validation examples of the stable hash split of the records at `path`, in a comparable order."""
    train, val, _ = ft().load_examples(ft().Config(data_path=str(path), val_fraction=0.1), tokenizer)
    assert train and val
    return sorted((e.input_ids, e.labels) for e in val)


def test_the_same_records_split_alike_however_written_and_in_whatever_format(tmp_path, tokenizers, offline_hub):
    """The same records are the same JSON values, a null field the same as an absent one (`datasets` fills a column
    a record lacks with None): JSONL with compact or default separators, non-ASCII escaped or not, and parquet hold
    the same records, and hold out the same ones (a record's key was its line as written: 113 of 600 moved)."""
    import datasets

    tokenizer = tokenizers["chatml"]
    records = reverse_task(600)
    for number, record in enumerate(records[::7]):  # some with a field the others lack: None in parquet
        record["source"] = f"batch {number}"
    written = {"default": lambda r: json.dumps(r), "compact": lambda r: json.dumps(r, separators=(",", ":")),
               "unescaped": lambda r: json.dumps(r, ensure_ascii=False, indent=None, separators=(", ", ": "))}
    for name, dump in written.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(dump(r) + "\n" for r in records), encoding="utf-8")
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "records.parquet"))
    assert datasets.Dataset.from_parquet(str(tmp_path / "records.parquet"))[1]["source"] is None  # absent there
    expected = held_out(tmp_path / "default.jsonl", tokenizer)
    for path in (*(tmp_path / f"{name}.jsonl" for name in written), tmp_path / "records.parquet"):
        assert held_out(path, tokenizer) == expected, path.name

    # chats with non-ASCII text: JSONL written unescaped, as most writers do, and parquet
    chats = multi_turn_chats(300)
    for number, chat in enumerate(chats[::2]):
        chat["messages"][1]["content"] = f"mot n°{number}: {chat['messages'][1]['content']} — «ça»"
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats),
                                          encoding="utf-8")
    datasets.Dataset.from_list(chats).to_parquet(str(tmp_path / "chats.parquet"))
    assert held_out(tmp_path / "chats.jsonl", tokenizer) == held_out(tmp_path / "chats.parquet", tokenizer)


def test_a_text_column_is_learned_whole_in_windows_of_max_length(tmp_path, tokenizers, offline_hub):
    import datasets

    tokenizer = tokenizers["chatml"]
    documents = [{"text": f"document {n}: " + "the quick brown fox " * 6} for n in range(40)]
    datasets.Dataset.from_list(documents).to_parquet(str(tmp_path / "text.parquet"))
    train, val, kind = ft().load_examples(ft().Config(data_path=str(tmp_path / "text.parquet"), max_length=16),
                                          tokenizer)
    assert kind == "text" and train and val
    assert all(2 <= len(e.input_ids) <= 16 and e.labels == e.input_ids for e in train + val)
    seventh = [e for e in train + val if json.loads(e.key) == documents[7]]  # a record's windows stay together
    assert all(e in train for e in seventh) or all(e in val for e in seventh)
    assert tokenizer.decode([t for e in seventh for t in e.input_ids]) == documents[7]["text"] + "<|im_end|>"


def test_a_validation_split_is_used_as_it_is_from_a_folder_a_saved_dataset_and_a_hub_id(tmp_path, tokenizers,
                                                                                        offline_hub):
    import datasets

    tokenizer = tokenizers["qwen3"]
    train_records, val_records = multi_turn_chats(40), multi_turn_chats(8, seed=7)
    folder = tmp_path / "folder"
    folder.mkdir()
    datasets.Dataset.from_list(train_records).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(val_records).to_parquet(str(folder / "validation-00000-of-00001.parquet"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(train_records),
                         validation=datasets.Dataset.from_list(val_records)).save_to_disk(str(tmp_path / "saved"))
    hub_cache(offline_hub, HUB_ID, {"train": train_records, "validation": val_records})
    expected = {"train": [p for r in train_records for p in ft().encode_record(r, tokenizer, 512)[0]],
                "validation": [p for r in val_records for p in ft().encode_record(r, tokenizer, 512)[0]]}
    for data_path in (folder, tmp_path / "saved", HUB_ID):
        train, val, kind = ft().load_examples(ft().Config(data_path=str(data_path)), tokenizer)
        assert kind == "chat", data_path
        assert [(e.input_ids, e.labels) for e in train] == expected["train"], data_path
        assert [(e.input_ids, e.labels) for e in val] == expected["validation"], data_path
    # --data_split / --data_val_split pick others; the training split alone falls back to the stable hash split
    train, val, _ = ft().load_examples(ft().Config(data_path=HUB_ID, data_split="validation", val_fraction=0.5),
                                       tokenizer)
    assert sorted((e.input_ids, e.labels) for e in train + val) == sorted(expected["validation"])


# ------------------------------------------------------------------------------------------ bad input
BAD = {  # name: (how the data is written, extra options, the expected part of the one error line)
    "column-missing": ("parquet", [{"prompt": "a", "completion": " b"}, {"prompt": "c", "completion": None}], (),
                       "data.parquet row 1: no 'completion' column beside 'prompt'"),
    "column-mistyped": ("parquet", [{"prompt": "a", "completions": " b"}], (),
                        "data.parquet row 0: no 'completion' column beside 'prompt' (did you mean completions?)"),
    "columns-of-another-tool": ("csv", [{"question": "a", "answer": "b"}], (),
                                "data.csv row 0: needs 'prompt' and 'completion', 'messages' or 'text' (TRL's "
                                "columns); it has 'question', 'answer'"),
    "value-of-another-type": ("jsonl", [{"prompt": "a", "completion": " b"}, {"prompt": "c", "completion": 3}], (),
                              "data.jsonl line 2: 'completion' must be a string, got int"),
    "role-the-template-refuses": ("jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}]},
                                            {"messages": [{"role": "user", "content": "a"},
                                                          {"role": "robot", "content": "beep"},
                                                          {"role": "assistant", "content": "b"}]}],
                                  ("--model", "{qwen3}"),
                                  "data.jsonl line 2: the chat template of --model refuses message 2 (role 'robot'): "
                                  "Unexpected message role: robot"),
    "split-missing": ("save_to_disk", [{"prompt": "a", "completion": " b"}] * 4, ("--data_split", "train_sft"),
                      "has no split 'train_sft' (its splits: train)"),
    "config-of-a-file": ("jsonl", [{"prompt": "a", "completion": " b"}] * 4, ("--data_config", "default"),
                         "--data_config names a configuration of a Hub dataset or of a folder of data files; "
                         "--data_path {tmp}/data.jsonl has none"),
    "hub-id-unknown": (None, None, ("--data_path", "someone/no-such-dataset"),
                       "--data_path someone/no-such-dataset: no such file or folder, and `datasets` cannot load it "
                       "as a Hub dataset (ConnectionError: "),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_is_one_error_line_exit_2_and_nothing_written(case, tmp_path, tiny_model, qwen3_model,
                                                              offline_hub, monkeypatch, capsys):
    import datasets

    how, records, options, expected = BAD[case]
    data = tmp_path / ("data." + how if how in ("parquet", "csv", "jsonl") else "saved")
    if how == "jsonl":
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif how == "save_to_disk":
        datasets.Dataset.from_list(records).save_to_disk(str(data))
    elif how:
        getattr(datasets.Dataset.from_list(records), f"to_{how}")(str(data), **({"index": False} if how == "csv"
                                                                                else {}))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model), "--data_path", str(data), "--output_dir", str(out), "--tracker", "none",
            *[o.format(qwen3=qwen3_model) for o in options]]
    start_clean_accelerate(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        ft().main(argv)
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and expected.format(tmp=tmp_path) in errors[0], errors
    assert not out.exists()  # refused before anything was written


# --------------------------------------------------------------------------------------------- training
def test_a_parquet_source_resumes_bit_exactly(tmp_path, tiny_model, monkeypatch):
    """Stopped after 3 steps and resumed: the same weights as 6 steps in one go (the split and order are the
    data's own, whatever reads it)."""
    import datasets
    from safetensors.torch import load_file

    datasets.Dataset.from_list(reverse_task(200)).to_parquet(str(tmp_path / "data.parquet"))
    common = ["--model", str(tiny_model), "--data_path", str(tmp_path / "data.parquet"), "--tracker", "none",
              "--max_steps", "6", "--batch_size", "8", "--eval_every_steps", "0", "--sample_tokens", "0",
              "--learning_rate", "3e-3", "--warmup_steps", "2"]
    for out, extra in (("whole", ()), ("parts", ("--stop_after_steps", "3")), ("parts", ("--resume", "auto"))):
        start_clean_accelerate(monkeypatch)
        ft().main([*common, "--output_dir", str(tmp_path / out), *extra])
    whole, parts = (load_file(str(tmp_path / out / "model" / "model.safetensors")) for out in ("whole", "parts"))
    assert whole.keys() == parts.keys() and all((whole[k] == parts[k]).all() for k in whole)


def test_a_run_split_by_the_older_record_keys_is_refused_on_resume_not_split_anew(tmp_path, tiny_model, monkeypatch,
                                                                                  capsys):
    """A checkpoint records that its run split records by their content; one without it (a run started when a
    record's key was its line as written) would hold out other records now, so it is refused in one line."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reverse_task(100)))
    run = ["--model", str(tiny_model), "--data_path", str(tmp_path / "data.jsonl"), "--tracker", "none",
           "--max_steps", "4", "--batch_size", "8", "--eval_every_steps", "0", "--sample_tokens", "0",
           "--output_dir", str(tmp_path / "run")]
    start_clean_accelerate(monkeypatch)
    ft().main([*run, "--stop_after_steps", "2"])
    progress = next((tmp_path / "run" / "checkpoints").glob("step_*/progress.json"))
    saved = json.loads(progress.read_text())
    assert saved["config"]["records split by"] == "content as canonical JSON"
    del saved["config"]["records split by"]  # as the older version wrote it
    progress.write_text(json.dumps(saved))
    capsys.readouterr()
    start_clean_accelerate(monkeypatch)
    with pytest.raises(SystemExit) as info:
        ft().main(run)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]  # not the bars
    assert info.value.code == 2 and len(errors) == 1, errors  # of loading the weights
    assert f"checkpoint {progress.parent} belongs to a run with other settings: records split by (not set) there, " \
           '"content as canonical JSON" now.' in errors[0]


STEPS = ("--max_steps", "16", "--eval_every_steps", "8", "--batch_size", "8", "--warmup_steps", "2",
         "--learning_rate", "3e-3", "--tracker", "none", "--sample_tokens", "4")


@pytest.fixture(scope="module")
def launches(tiny_model, qwen3_model, tmp_path_factory):
    """A Hub id (offline, from a local cache) of multi-turn chats with the Qwen3-style template on 1 process; a
    `save_to_disk` dataset and a JSON file on 2 ranks (both ranks building the `datasets` cache at once)."""
    import datasets

    root = tmp_path_factory.mktemp("finetune_data")
    cache = hub_cache(root / "hub_cache", HUB_ID, {"train": multi_turn_chats(300), "validation": multi_turn_chats(
        40, seed=9)})
    datasets.DatasetDict(train=datasets.Dataset.from_list(reverse_task(300)),
                         validation=datasets.Dataset.from_list(reverse_task(40, seed=5))).save_to_disk(
        str(root / "saved"))
    (root / "data.json").write_text(json.dumps(reverse_task(300)))
    runs = {"hub-qwen3-chat": ("cpu.yaml", qwen3_model, HUB_ID), "ddp-save-to-disk": ("cpu_ddp.yaml", tiny_model,
                                                                                      str(root / "saved")),
            "ddp-json": ("cpu_ddp.yaml", tiny_model, str(root / "data.json"))}

    def run(name):
        config, model, data = runs[name]
        env = clean_env(HF_DATASETS_CACHE=str(cache if name == "hub-qwen3-chat" else root / f"{name}_cache"),
                        HF_HUB_OFFLINE="1")
        result = launch(config, TEMPLATE, "--model", str(model), "--data_path", data, "--output_dir",
                        str(root / name), *STEPS, env=env, timeout=400)
        return {"result": result, "out": root / name}

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(runs, pool.map(run, runs)))


@pytest.mark.parametrize("name, train, val", [("hub-qwen3-chat", 300 + 100, 40 + 14), ("ddp-save-to-disk", 300, 40),
                                              ("ddp-json", None, None)])
def test_each_source_trains_and_uses_its_validation_split(launches, name, train, val):
    result = launches[name]["result"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    if train:  # the chats whose first answer holds reasoning (1 in 3) are two examples each
        assert f"{train} training / {val} validation examples" in result.stdout, result.stdout[-3000:]
    logged = [json.loads(line) for line in (launches[name]["out"] / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val/loss"] for r in logged if "val/loss" in r]
    assert [r["step"] for r in logged if "val/loss" in r] == [0, 8, 16] and losses[-1] < 0.8 * losses[0], losses
    assert (launches[name]["out"] / "model" / "model.safetensors").is_file()
