"""The tokenized-data pipeline with the real tokenizers library: sources, the prepared format,
sample order, the command, the cache and the built-in model directory. One process, no GPU; a
small byte-level BPE is trained here."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from liveshard_agent.data import builtin
from liveshard_agent.data.corpus import builtin_corpus
from liveshard_agent.data.order import Order, sample_count, sample_ids, windows
from liveshard_agent.data.prepare import cached, main, prepare, resolve_data
from liveshard_agent.data.sources import documents
from liveshard_agent.data.tokens import TokenStream
from liveshard_core.errors import InvalidInput
from liveshard_core.job import JobConfig
from liveshard_core.vps.hf import HfModel
from liveshard_core.vps.presets import CONFIGS

ROOT = Path(__file__).resolve().parents[3]
EOS = "<eos>"
TEXT = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum tunes"
WORDS = TEXT.split()


def sentence(k: int) -> str:
    return " ".join(WORDS[(k * 7 + i * 3) % len(WORDS)] for i in range(3 + k % 9)) + "."


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 300 ids with `<eos>` (id 0), and a config.json naming it (a list)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([sentence(k) for k in range(500)], trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS)
    (directory / "config.json").write_text(json.dumps({"eos_token_id": [eos, 99]}))
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def write_inputs(root: Path) -> tuple[list[Path], list[str]]:
    """A jsonl, a parquet of three row groups, a text file and a folder of both kinds (with a
    hidden file that must be skipped); the inputs and their documents in order."""
    root.mkdir(parents=True, exist_ok=True)
    jsonl_docs = [sentence(k) for k in range(5)] + ["", "naïve café ✓ — 日本"]
    jsonl = root / "a.jsonl"
    lines = [json.dumps({"text": t, "id": k}) for k, t in enumerate(jsonl_docs)]
    jsonl.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
    parquet_docs = [sentence(k) * 3 for k in range(10, 17)]
    parquet = root / "b.parquet"
    pq.write_table(pa.table({"text": parquet_docs, "n": range(7)}), parquet, row_group_size=3)
    text_doc = "a whole file\nof two lines, one document\n"
    text = root / "c.txt"
    text.write_text(text_doc)
    folder = root / "d"
    (folder / "sub").mkdir(parents=True)
    (folder / "z.md").write_text("last in the folder")
    (folder / "sub" / "m.jsonl").write_text(json.dumps({"text": "in a sub folder"}) + "\n")
    (folder / "b.txt").write_text("first in the folder")
    (folder / ".hidden").write_text("never read")
    folder_docs = ["first in the folder", "in a sub folder", "last in the folder"]
    inputs = [jsonl, parquet, text, folder]
    return inputs, jsonl_docs + parquet_docs + [text_doc] + folder_docs


def expected_tokens(tokenizer: Tokenizer, docs: list[str]) -> list[int]:
    eos = tokenizer.token_to_id(EOS)
    assert eos is not None
    return [t for doc in docs for t in [*tokenizer.encode(doc).ids, eos]]


def test_documents_keep_input_order_and_skip_hidden(tmp_path: Path) -> None:
    inputs, docs = write_inputs(tmp_path)
    assert list(documents(inputs)) == docs


def test_prepared_tokens_equal_encode_plus_eos(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: Tokenizer
) -> None:
    inputs, docs = write_inputs(tmp_path / "in")
    out = prepare(inputs, tokenizer_dir, tmp_path / "out", batch_docs=4, progress=False)
    stream = TokenStream.open(out)
    expected = expected_tokens(tokenizer, docs)
    assert stream.tokens.dtype == np.uint16
    assert stream.tokens.tolist() == expected
    index = stream.index
    assert (index.tokens, index.documents) == (len(expected), len(docs))
    assert index.eos_token_id == tokenizer.token_to_id(EOS)
    assert index.vocab_size == 300 and index.max_token == max(expected)
    assert index.sources == tuple(str(p.absolute()) for p in inputs)
    for k, doc in enumerate(docs):
        assert stream.document(k).tolist() == expected_tokens(tokenizer, [doc])
    assert sorted(p.name for p in out.iterdir()) == ["documents.npy", "index.json", "tokens.bin"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_prepare_reuses_the_same_preparation_and_replaces_another(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    inputs, _ = write_inputs(tmp_path / "in")
    out = prepare(inputs[:1], tokenizer_dir, tmp_path / "out", progress=False)
    written = (out / "tokens.bin").stat().st_mtime_ns
    assert prepare(inputs[:1], tokenizer_dir, out, progress=False) == out
    assert (out / "tokens.bin").stat().st_mtime_ns == written
    prepare(inputs[:2], tokenizer_dir, out, progress=False)
    assert TokenStream.open(out).index.sources == tuple(str(p) for p in inputs[:2])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("not mine")
    with pytest.raises(InvalidInput, match="not a prepared data directory"):
        prepare(inputs[:1], tokenizer_dir, tmp_path / "other", progress=False)


def test_eos_id_from_the_flag_or_an_error(tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs, _ = write_inputs(tmp_path / "in")
    bare = tmp_path / "bare.json"
    bare.write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(InvalidInput, match=r"config\.json does not exist; give --eos-id"):
        prepare(inputs[:1], bare, tmp_path / "out", progress=False)
    out = prepare(inputs[:1], bare, tmp_path / "out", eos_id=5, progress=False)
    stream = TokenStream.open(out)
    assert stream.index.eos_token_id == 5 and int(stream.tokens[-1]) == 5


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', r"missing.jsonl:2: .*'text'"),
        ("broken.jsonl", '{"text": "a"}\n\n{"text": \n', r"broken.jsonl:3: invalid JSON"),
        ("number.jsonl", '{"text": 7}\n', r"number.jsonl:1: field 'text' is a int"),
        ("empty.txt", "", r"empty.txt: the file is empty"),
        ("binary.txt", b"ok \xff\xfe bytes", r"binary.txt: not UTF-8 text"),
        ("nodocs.jsonl", "\n  \n", r"nodocs.jsonl: holds no documents"),
    ],
)
def test_bad_inputs_name_the_file_and_line(
    tmp_path: Path, tokenizer_dir: Path, name: str, content: str | bytes, message: str
) -> None:
    bad = tmp_path / name
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(content)
    with pytest.raises(InvalidInput, match=message):
        prepare([bad], tokenizer_dir, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # neither out nor a temp


def test_parquet_without_the_column(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(InvalidInput, match=r"t.parquet: no column 'text'.*\['body'\]"):
        prepare([path], tokenizer_dir, tmp_path / "out", progress=False)
    assert (
        TokenStream.open(
            prepare([path], tokenizer_dir, tmp_path / "out", field="body", progress=False)
        ).documents
        == 1
    )


def test_short_corpus_vocab_and_corrupt_files(tmp_path: Path, tokenizer_dir: Path) -> None:
    (tmp_path / "s.txt").write_text("the fox")
    out = prepare([tmp_path / "s.txt"], tokenizer_dir, tmp_path / "out", progress=False)
    stream = TokenStream.open(out)
    with pytest.raises(InvalidInput, match=f"{out}: corpus shorter than one sample"):
        sample_count(stream, len(stream))
    assert sample_count(stream, len(stream) - 1) == 1
    stream.check_vocab(300)
    largest = stream.index.max_token
    with pytest.raises(InvalidInput, match=f"{out}: holds token id {largest}, .* {largest} ids"):
        stream.check_vocab(largest)
    tokens = out / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-2])
    with pytest.raises(InvalidInput, match=f"{tokens}: .* bytes; index.json says"):
        TokenStream.open(out)


def test_sequential_windows_are_stream_slices(tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs, _ = write_inputs(tmp_path / "in")
    stream = TokenStream.open(prepare(inputs, tokenizer_dir, tmp_path / "out", progress=False))
    seq_len = 16
    n = sample_count(stream, seq_len)
    assert n == (len(stream) - 1) // seq_len
    ids = sample_ids("sequential", 0, n, n - 2, 5)  # crosses into the next epoch
    assert ids.tolist() == [n - 2, n - 1, 0, 1, 2]
    got = windows(stream, ids, seq_len)
    assert got.dtype == np.int64 and got.shape == (5, seq_len + 1)
    for row, j in zip(got, ids.tolist(), strict=True):
        assert row.tolist() == stream.tokens[j * seq_len : j * seq_len + seq_len + 1].tolist()
    with pytest.raises(InvalidInput, match=f"sample {n} is not in"):
        windows(stream, np.array([n]), seq_len)


def reference_perm(seed: int, epoch: int, n: int, p: int) -> int:
    """The permutation exactly as order.py's docstring writes it, in plain Python integers."""
    m64, g = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        return z ^ (z >> 31)

    key = mix((mix((seed + g) & m64) + epoch) & m64)
    keys = [mix((key + (r + 1) * g) & m64) for r in range(6)]
    b = max(2, (n - 1).bit_length())

    def feistel(x: int) -> int:
        w = b // 2
        for k in keys:
            right, left = x & ((1 << w) - 1), x >> w
            x = (right << (b - w)) | ((left ^ mix(right ^ k)) & ((1 << (b - w)) - 1))
            w = b - w
        return x

    y = feistel(p)
    while y >= n:
        y = feistel(y)
    return y


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097])
def test_shuffled_ids_permute_each_epoch(n: int) -> None:
    for seed in (0, 1, 20260101):
        first = sample_ids(Order.SHUFFLED, seed, n, 0, n)
        second = sample_ids(Order.SHUFFLED, seed, n, n, n)
        assert sorted(first.tolist()) == list(range(n))
        assert sorted(second.tolist()) == list(range(n))
        assert first.dtype == np.int64
        assert np.array_equal(first, sample_ids("shuffled", seed, n, 0, n))  # deterministic
        both = sample_ids("shuffled", seed, n, n // 2, n)  # across the epoch boundary
        assert np.array_equal(both, np.concatenate([first[n // 2 :], second[: n // 2]]))
        picks = range(0, 2 * n, max(1, n // 50))
        assert [reference_perm(seed, i // n, n, i % n) for i in picks] == [
            int(sample_ids("shuffled", seed, n, i, 1)[0]) for i in picks
        ]
        if n >= 7:
            assert not np.array_equal(first, second)
            assert not np.array_equal(first, sample_ids("shuffled", seed + 1, n, 0, n))
            assert not np.array_equal(first, np.arange(n))


def test_sample_ids_reject_bad_arguments() -> None:
    with pytest.raises(InvalidInput, match="'random': must be one of"):
        sample_ids("random", 0, 10, 0, 1)
    with pytest.raises(InvalidInput, match="corpus shorter than one sample"):
        sample_ids("sequential", 0, 0, 0, 1)


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "liveshard_agent.data.prepare", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_cli_exit_status(tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs, _ = write_inputs(tmp_path / "in")
    good = run_cli("prepare", "--tokenizer", tokenizer_dir, "--out", tmp_path / "out", *inputs)
    assert good.returncode == 0, good.stderr
    assert "tokens in 18 documents (uint16" in good.stdout
    (tmp_path / "bad.jsonl").write_text("{nope}\n")
    flags: list[str | Path] = ["--tokenizer", tokenizer_dir, "--out", tmp_path / "out2"]
    bad = run_cli("prepare", *flags, tmp_path / "bad.jsonl")
    assert bad.returncode == 2
    assert bad.stderr.startswith("liveshard-data: ") and bad.stderr.count("\n") == 1
    assert "bad.jsonl:1: invalid JSON" in bad.stderr
    assert main(["prepare", *map(str, flags), str(tmp_path / "missing")]) == 2


def test_cached_tokenizes_once_beside_the_first_input(tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs, _ = write_inputs(tmp_path / "in")
    first = cached(inputs, tokenizer_dir, progress=False)
    assert first.parent == inputs[0].parent
    assert first.name.startswith(".a.jsonl.liveshard-tokens-") and len(first.name) == 38
    written = (first / "tokens.bin").stat().st_mtime_ns
    assert cached(inputs, tokenizer_dir, progress=False) == first
    assert (first / "tokens.bin").stat().st_mtime_ns == written
    assert resolve_data(inputs, tokenizer_dir).directory == first
    assert resolve_data([first], tokenizer_dir).directory == first
    os.utime(inputs[2], ns=(written, written + 10**9))  # a touched input: a new preparation
    assert cached(inputs, tokenizer_dir, progress=False) != first
    # A cache inside a folder input is hidden, so the folder does not read it back.
    folder = inputs[3]
    inner = cached([folder / "b.txt", folder], tokenizer_dir, progress=False)
    assert inner.parent == folder
    assert cached([folder / "b.txt", folder], tokenizer_dir, progress=False) == inner


def test_cached_is_safe_when_processes_race(tmp_path: Path, tokenizer_dir: Path) -> None:
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": sentence(k) * 20}) + "\n" for k in range(3000)))
    results: list[Path] = []
    start = threading.Barrier(3)

    def run() -> None:
        start.wait()
        results.append(cached([big], tokenizer_dir, progress=False))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(results) == 3
    assert TokenStream.open(results[0]).documents == 3000
    assert {p.name for p in tmp_path.iterdir()} == {"big.jsonl", results[0].name}  # no temp


def test_builtin_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Made twice (two cache roots): byte-identical tokenizers; the config and round trip."""
    made = []
    for name in ("one", "two"):
        monkeypatch.setenv("LIVESHARD_CACHE", str(tmp_path / name))
        builtin.builtin_model_dir.cache_clear()
        builtin.builtin_tokens.cache_clear()
        made.append(builtin.builtin_model_dir())
    first, second = made
    assert first.parent == tmp_path / "one" / "models"
    assert second.parent == tmp_path / "two" / "models"
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    config = json.loads((second / "config.json").read_text())
    expected = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
        "attention_bias": False,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "use_sliding_window": False,
    }
    assert {key: config[key] for key in expected} == expected
    tokenizer = Tokenizer.from_file(str(second / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    assert config["eos_token_id"] == config["bos_token_id"] == tokenizer.token_to_id(builtin.EOS)
    text = builtin_corpus().decode().split(". ")[3] + ". Nie gesehen: ünï 🚀\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    stream = TokenStream.open(builtin.builtin_tokens())
    stream.check_vocab(512)
    assert stream.tokens.dtype == np.uint16 and len(stream) > 100_000
    assert builtin.builtin_tokens() == stream.directory


def test_builtin_preset_is_the_builtin_directory() -> None:
    """The `qwen3-tiny` preset has the built-in directory's shape, and a job of it trains with
    that directory's tokenizer; another preset's job has no directory."""
    directory = builtin.builtin_model_dir()
    read = HfModel.load(directory).config
    assert dataclasses.replace(read, name=builtin.PRESET) == CONFIGS[builtin.PRESET]
    model = builtin.job_model(JobConfig(model=CONFIGS[builtin.PRESET]))
    assert model is not None and model.directory == directory
    assert builtin.job_model(JobConfig(model=CONFIGS["tiny"])) is None
    path = JobConfig(model=read, model_path=str(directory))
    assert builtin.job_model(path) is path.hf_model
