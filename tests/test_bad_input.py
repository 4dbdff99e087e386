"""A user's mistakes, through the real `taps` entry point: every case exits with code 2 and one
error line naming the culprit, shows no traceback, and leaves the earlier results of the
workspace (features, eval results, a training run, a drafter, data) byte-identical. Plus the three
ways two runs used to mix silently (same tokenizer, other weights; a changed training resume),
resuming directories written before run identities were recorded, and the one-writer lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from taps.cli.main import main
from taps.core.testing import write_tiny_target

RECORDS = [{"id": f"r{i}", "source": "chat" if i % 2 else "math",
            "conversations": [{"role": "user", "content": f"How many clips, {i}?"},
                              {"role": "assistant", "content": "48/2 = 24 clips. The quick brown fox. " * (1 + i % 3)}]}
           for i in range(8)]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stdout + stderr of one in-process `taps` run (argparse exits by SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out + out.err


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the workspace (the lock files aside: a refused writer may take them)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".taps.lock"}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace with a finished run of every kind, made through the CLI, and bad inputs beside it."""
    ws = tmp_path_factory.mktemp("ws")
    write_tiny_target(ws / "tgt", seed=0)
    write_tiny_target(ws / "tgt2", seed=1)  # the same tokenizer, other weights: a base model and its tune
    (ws / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (ws / "data2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:6]))
    (ws / "empty.jsonl").write_text("")
    (ws / "latin1.jsonl").write_bytes(json.dumps(RECORDS[0]).encode() + b"\n" + "caf\u00e9\n".encode("latin-1"))
    (ws / "bad.jsonl").write_text("{not json\n")
    (ws / "afile").write_text("a file, not a directory\n")
    (ws / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["How many clips?"]}) + "\n")
    (ws / "noq.jsonl").write_text("\n")
    (ws / "badrun").mkdir()
    (ws / "badrun" / "run.json").write_text('{"tree": [6, 2, 2],\n')
    shutil.copytree(ws / "tgt", ws / "cut")
    weights = ws / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(ws / "tgt", ws / "badcfg")
    (ws / "badcfg" / "config.json").write_text("{")
    t = str(ws / "tgt")
    steps = [["drafter", "init", "--target", t, "--out", str(ws / "d")],
             ["drafter", "init", "--target", t, "--out", str(ws / "d2"), "--seed", "2"],
             ["features", "--target", t, "--data", str(ws / "data.jsonl"), "--out", str(ws / "feat"),
              "--dtype", "fp32", "--device", "cpu", "--target-dtype", "float32"],
             ["features", "--target", t, "--data", str(ws / "data2.jsonl"), "--out", str(ws / "feat2"),
              "--dtype", "fp32", "--device", "cpu", "--target-dtype", "float32"],
             ["train", "--target", t, "--features", str(ws / "feat"), "--out", str(ws / "run"), "--epochs", "1",
              "--batch-size", "2", "--warmup-steps", "0", "--cpu"],
             ["eval", "--target", t, "--variant", "base=baseline", "--variant", f"d={ws / 'd'}", "--bench",
              f"toy={ws / 'q.jsonl'}", "--out", str(ws / "results"), "--max-new-tokens", "4", "--device", "cpu",
              "--total-tokens", "6", "--depth", "2", "--top-k", "2", "--no-progress"]]
    steps.append(["lookup", "build", "--records", str(ws / "data.jsonl"), "--target", t, "--out", str(ws / "ds")])
    steps.append(["data", "mix", "--source", f"messages:{ws / 'data.jsonl'}", "--out", str(ws / "mixed-before.jsonl")])
    for argv in steps:
        assert main(argv) == 0, argv
    os.mkfifo(ws / "fifo")
    (ws / "bench" / "gsm8k").mkdir(parents=True)  # the drafter table's benchmarks, one question each
    (ws / "bench" / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    (ws / "bench" / "mt_bench").mkdir()
    shutil.copy(ws / "q.jsonl", ws / "bench" / "mt_bench" / "question.jsonl")
    (ws / "heads").mkdir()
    shutil.copytree(ws / "d", ws / "heads" / "d")
    (ws / "link.jsonl").symlink_to(ws / "data2.jsonl")
    shutil.copytree(ws / "d", ws / "d-nan")  # a head whose weights diverged
    from safetensors.torch import load_file, save_file
    weights = load_file(ws / "d-nan" / "model.safetensors")
    weights["fc.weight"][0, 0] = float("nan")
    save_file(weights, ws / "d-nan" / "model.safetensors", metadata={"format": "pt"})
    write_study_configs(ws)
    shutil.copytree(ws / "ds", ws / "ds-other")  # a datastore of another tokenizer
    manifest = json.loads((ws / "ds-other" / "datastore.json").read_text())
    (ws / "ds-other" / "datastore.json").write_text(json.dumps({**manifest, "target": "other-model",
                                                                "tokenizer_fingerprint": "sha256:" + "0" * 32}))
    shutil.copytree(ws / "ds", ws / "ds-cut")  # tokens that are not the ones the manifest describes
    for index in (ws / "ds-cut").glob("index-*.npy"):
        index.unlink()
    tokens = bytearray((ws / "ds-cut" / "tokens.npy").read_bytes())
    tokens[-8] ^= 1
    (ws / "ds-cut" / "tokens.npy").write_bytes(bytes(tokens))
    shutil.copytree(ws / "ds", ws / "ds-stale")  # tokens changed after the index was built from them
    assert list((ws / "ds-stale").glob("index-*.npy"))
    (ws / "ds-stale" / "tokens.npy").write_bytes(bytes(tokens))
    return ws


STUDY = """name: s
out: {ws}/study
target: {{path: {ws}/tgt}}
drafters: {{out: {ws}}}
variants: {{base: baseline}}
eval: {{bench: [toy={ws}/q.jsonl], device: cpu{eval}}}
"""
STUDY_CONFIGS = {  # name: (eval keys, extra top-level lines)
    "nan-temperature": (", max_new_tokens: 4, temperatures: [0, .nan]", ""),
    "limit-abc": (", max_new_tokens: 4, limit: abc", ""),
    "max-new-tokens-0": (", max_new_tokens: 0", ""),
    "seed-1e23": (", max_new_tokens: 4, seed: 1e23", ""),
    "categories-string": (", max_new_tokens: 4, categories: writing", ""),
    "lambdas-string": (", max_new_tokens: 4", "lambdas: '0.5'\n"),
    "backbones-string": (", max_new_tokens: 4", "backbones: eagle2\n"),
    "duplicate-key": (", max_new_tokens: 4", "out: {ws}/elsewhere\n"),
}


def write_study_configs(ws: Path) -> None:
    """One study config per mistake (STUDY_CONFIGS), and a binary file where a config should be."""
    for name, (eval_keys, lines) in STUDY_CONFIGS.items():
        text = STUDY.format(ws=ws, eval=eval_keys.replace("{ws}", str(ws))) + lines.replace("{ws}", str(ws))
        (ws / f"{name}.yaml").write_text(text)
    (ws / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")


class _Endpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint that answers nonsense: /bad-models lists models as a string,
    /bad-chat answers a chat completion without choices."""

    def _answer(self, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({"data": "abc"} if self.path.startswith("/bad-models") else {"data": [{"id": "m"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer({"choices": "abc"})

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def net():
    """A malformed endpoint ({url}) and a port some other program listens on ({port})."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    yield {"{url}": f"http://127.0.0.1:{server.server_address[1]}", "{port}": str(busy.getsockname()[1])}
    server.shutdown()
    busy.close()


T, T2, CUT = "{ws}/tgt", "{ws}/tgt2", "{ws}/cut"


def opts(argv: list[str], **values: str) -> list[str]:
    """argv with options set: `max_new_tokens="8"` replaces the value after --max-new-tokens (or adds it)."""
    argv = list(argv)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


GEN = ["generate", "--target", T, "--prompt", "hi", "--device", "cpu"]
FEAT = ["features", "--target", T, "--data", "{ws}/data.jsonl", "--dtype", "fp32", "--device", "cpu",
        "--target-dtype", "float32"]
TRAIN = ["train", "--target", T, "--features", "{ws}/feat", "--epochs", "1", "--batch-size", "2", "--warmup-steps",
         "0", "--cpu"]
EVAL = ["eval", "--target", T, "--variant", "base=baseline", "--variant", "d={ws}/d", "--bench", "toy={ws}/q.jsonl",
        "--max-new-tokens", "4", "--device", "cpu", "--total-tokens", "6", "--depth", "2", "--top-k", "2",
        "--no-progress"]
MIX = ["data", "mix", "--out", "{ws}/mixed.jsonl", "--source"]
AVG = ["average", "--drafter", "a={ws}/d", "--drafter", "b={ws}/d2"]
LOOKUP = ["lookup", "build", "--records", "{ws}/data.jsonl", "--target", T, "--out", "{ws}/dsx"]

# (case id, argv, what the one error line must name)
CASES = [
    # generate
    ("generate-missing-target", ["generate", "--target", "{ws}/nope", "--prompt", "hi"], ["nope"]),
    ("generate-truncated-weights", ["generate", "--target", CUT, "--prompt", "hi"], ["cut/model.safetensors", "truncated"]),
    ("generate-corrupt-config", ["generate", "--target", "{ws}/badcfg", "--prompt", "hi"], ["badcfg/config.json"]),
    ("generate-target-is-data", ["generate", "--target", "{ws}/data.jsonl", "--prompt", "hi"], ["data.jsonl"]),
    ("generate-device-tpu", GEN + ["--device", "tpu"], ["--device", "tpu"]),
    ("generate-prompt-not-utf8", ["generate", "--target", T, "--prompt", "caf\udce9"], ["not UTF-8"]),
    ("generate-max-new-tokens-0", GEN + ["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    ("generate-max-new-tokens-negative", GEN + ["--max-new-tokens", "-5"], ["--max-new-tokens"]),
    ("generate-total-tokens-0", GEN + ["--total-tokens", "0"], ["--total-tokens"]),
    ("generate-depth-above-total", GEN + ["--drafter", "{ws}/d", "--total-tokens", "4", "--depth", "9"],
     ["--depth 9", "--total-tokens 4"]),
    ("generate-top-k-abc", GEN + ["--top-k", "abc"], ["--top-k", "abc"]),
    ("generate-missing-drafter", GEN + ["--drafter", "{ws}/nodrafter"], ["nodrafter/config.json"]),
    ("generate-prompt-ids", ["generate", "--target", T, "--prompt-ids", "1,a"], ["--prompt-ids"]),
    ("generate-dtype", GEN + ["--dtype", "float64"], ["--dtype", "float64"]),
    ("generate-unknown-strategy", GEN + ["--strategy", "vote"], ["--strategy", "vote"]),
    ("generate-bad-variant", GEN + ["--variant", "merge-union:{ws}/d,{ws}/d2"],
     ["--variant merge-union:{ws}/d,{ws}/d2", "unknown option 'union' for merge; expected one of disjoint, trie, budget"]),
    ("generate-variant-of-one", GEN + ["--variant", "route:{ws}/d"], ["--variant route:{ws}/d", "at least two drafters"]),
    ("generate-variant-and-drafter", GEN + ["--variant", "{ws}/d", "--drafter", "{ws}/d2"], ["--variant", "--drafter"]),
    ("generate-route-one-drafter", GEN + ["--drafter", "{ws}/d", "--strategy", "route"],
     ["--strategy route", "at least two drafters, got 1"]),
    ("generate-lookup-missing-datastore", GEN + ["--variant", "lookup+{ws}/nods"], ["nods", "not a datastore"]),
    ("generate-datastore-other-tokenizer", GEN + ["--variant", "lookup+{ws}/ds-other"],
     ["ds-other", "'other-model'", "tokenizer"]),
    ("generate-datastore-corrupt-tokens", GEN + ["--drafter", "{ws}/ds-cut"], ["ds-cut/tokens.npy", "digest"]),
    # lookup build
    ("lookup-build-missing-records", LOOKUP + ["--records", "{ws}/nodata.jsonl"], ["--records", "nodata.jsonl"]),
    ("lookup-build-bad-json", LOOKUP + ["--records", "{ws}/data.jsonl,{ws}/bad.jsonl"], ["bad.jsonl:1"]),
    ("lookup-build-latin1", LOOKUP + ["--records", "{ws}/latin1.jsonl"], ["latin1.jsonl:2", "UTF-8"]),
    ("lookup-build-not-records", LOOKUP + ["--records", "{ws}/q.jsonl"], ["q.jsonl:1", "conversations"]),
    ("lookup-build-no-answers", LOOKUP + ["--records", "{ws}/empty.jsonl"], ["empty.jsonl", "no assistant turns"]),
    ("lookup-build-over-a-datastore", LOOKUP + ["--out", "{ws}/ds"], ["--out", "ds", "--force"]),
    ("lookup-build-out-holds-a-drafter", opts(LOOKUP, out="{ws}/d"), ["--out {ws}/d", "holds a drafter"]),
    ("lookup-build-out-is-file", opts(LOOKUP, out="{ws}/afile"), ["afile"]),
    ("lookup-build-index-depth-0", LOOKUP + ["--index-depth", "0"], ["--index-depth 0"]),
    ("lookup-build-missing-target", opts(LOOKUP, target="{ws}/nope"), ["nope"]),
    # drafter
    ("drafter-init-out-is-file", ["drafter", "init", "--target", T, "--out", "{ws}/afile"], ["afile"]),
    ("drafter-init-out-under-file", ["drafter", "init", "--target", T, "--out", "{ws}/afile/d"], ["afile"]),
    ("drafter-init-missing-target", ["drafter", "init", "--target", "{ws}/nope", "--out", "{ws}/dx"], ["nope"]),
    ("reduce-vocab-size-0", ["drafter", "reduce-vocab", "--drafter", "{ws}/d", "--features", "{ws}/feat", "--size", "0",
                             "--out", "{ws}/dr"], ["draft vocabulary size 0"]),
    ("reduce-vocab-missing-features", ["drafter", "reduce-vocab", "--drafter", "{ws}/d", "--features", "{ws}/nofeat",
                                       "--size", "10", "--out", "{ws}/dr"], ["nofeat/manifest.json"]),
    # features
    ("features-max-len-0", FEAT + ["--out", "{ws}/fx", "--max-len", "0"], ["--max-len"]),
    ("features-records-per-shard-0", FEAT + ["--out", "{ws}/fx", "--records-per-shard", "0"], ["--records-per-shard"]),
    ("features-tokens-per-batch-negative", FEAT + ["--out", "{ws}/fx", "--tokens-per-batch", "-1"],
     ["--tokens-per-batch"]),
    ("features-empty-data", ["features", "--target", T, "--data", "{ws}/empty.jsonl", "--out", "{ws}/fx"],
     ["empty.jsonl", "no records"]),
    ("features-latin1-data", ["features", "--target", T, "--data", "{ws}/latin1.jsonl", "--out", "{ws}/fx"],
     ["latin1.jsonl:2", "UTF-8"]),
    ("features-bad-json", ["features", "--target", T, "--data", "{ws}/bad.jsonl", "--out", "{ws}/fx"], ["bad.jsonl:1"]),
    ("features-missing-data", ["features", "--target", T, "--data", "{ws}/nodata.jsonl", "--out", "{ws}/fx"],
     ["nodata.jsonl"]),
    ("features-out-is-file", FEAT + ["--out", "{ws}/afile"], ["afile"]),
    ("features-other-weights", ["features", "--target", T2, "--data", "{ws}/data.jsonl", "--out", "{ws}/feat",
                                "--dtype", "fp32", "--device", "cpu", "--target-dtype", "float32"],
     ["target_weights", "feat/manifest.json"]),
    ("features-other-target-dtype", opts(FEAT, target_dtype="bfloat16", out="{ws}/feat"), ["target_dtype"]),
    ("features-other-data", ["features", "--target", T, "--data", "{ws}/data2.jsonl", "--out", "{ws}/feat",
                             "--dtype", "fp32", "--device", "cpu", "--target-dtype", "float32"], ["data_digest"]),
    ("features-other-max-len", FEAT + ["--out", "{ws}/feat", "--max-len", "100"], ["max_len"]),
    ("features-device-tpu", ["features", "--target", T, "--data", "{ws}/data.jsonl", "--out", "{ws}/fx", "--device",
                             "tpu"], ["--device"]),
    ("features-truncated-target", ["features", "--target", CUT, "--data", "{ws}/data.jsonl", "--out", "{ws}/fx"],
     ["cut/model.safetensors"]),
    # train
    ("train-epochs-0", TRAIN + ["--out", "{ws}/rx", "--epochs", "0"], ["--epochs"]),
    ("train-batch-size-0", TRAIN + ["--out", "{ws}/rx", "--batch-size", "0"], ["--batch-size"]),
    ("train-lr-negative", TRAIN + ["--out", "{ws}/rx", "--lr", "-1"], ["lr", "-1"]),
    ("train-missing-features", ["train", "--target", T, "--features", "{ws}/nofeat", "--out", "{ws}/rx", "--cpu"],
     ["nofeat/manifest.json"]),
    ("train-features-of-other-weights", ["train", "--target", T2, "--features", "{ws}/feat", "--out", "{ws}/rx",
                                         "--cpu"], ["target_weights", "feat/manifest.json"]),
    ("train-without-resume", TRAIN + ["--out", "{ws}/run"], ["--resume"]),
    ("train-resume-backbone", TRAIN + ["--out", "{ws}/run", "--resume", "--backbone", "hass"],
     ["backbone", "'eagle2'", "'hass'"]),
    ("train-resume-lr", TRAIN + ["--out", "{ws}/run", "--resume", "--lr", "0.001"], ["lr = 3e-05", "0.001"]),
    ("train-resume-epochs", opts(TRAIN, epochs="2", out="{ws}/run") + ["--resume"], ["epochs = 1", "2"]),
    ("train-resume-features", ["train", "--target", T, "--features", "{ws}/feat2", "--epochs", "1", "--batch-size", "2",
                               "--warmup-steps", "0", "--cpu", "--out", "{ws}/run", "--resume"], ["features"]),
    ("train-out-is-file", TRAIN + ["--out", "{ws}/afile"], ["afile"]),
    # data mix
    ("mix-empty-source", MIX + ["messages:{ws}/empty.jsonl"], ["empty.jsonl"]),
    ("mix-negative-count", MIX + ["gsm8k:{ws}/data.jsonl:-2"], ["-2", "positive"]),
    ("mix-zero-count", MIX + ["messages:{ws}/data.jsonl:0"], ["count must be positive"]),
    ("mix-unknown-source", MIX + ["nosuch:{ws}/data.jsonl"], ["nosuch"]),
    ("mix-latin1", MIX + ["messages:{ws}/latin1.jsonl"], ["latin1.jsonl:2", "UTF-8"]),
    ("mix-missing-file", MIX + ["messages:{ws}/nodata.jsonl"], ["nodata.jsonl"]),
    ("mix-out-under-file", ["data", "mix", "--source", "messages:{ws}/data.jsonl", "--out", "{ws}/afile/m.jsonl"],
     ["afile"]),
    # eval
    ("eval-limit-0", EVAL + ["--out", "{ws}/ex", "--limit", "0"], ["--limit"]),
    ("eval-jobs-negative", EVAL + ["--out", "{ws}/ex", "--jobs", "-1"], ["--jobs"]),
    ("eval-other-weights", opts(EVAL, target=T2, out="{ws}/results"),
     ["target_weights", "results/run.json"]),
    ("eval-other-max-new-tokens", opts(EVAL, max_new_tokens="8", out="{ws}/results"), ["max_new_tokens"]),
    ("eval-other-tree", opts(EVAL, top_k="3", out="{ws}/results"), ["tree"]),
    ("eval-empty-bench", ["eval", "--target", T, "--variant", "base=baseline", "--bench", "toy={ws}/noq.jsonl",
                          "--out", "{ws}/ex"], ["noq.jsonl"]),
    ("eval-bad-variant", ["eval", "--target", T, "--variant", "x=route-sideways:{ws}/d,{ws}/d2", "--out", "{ws}/ex"],
     ["--variant"]),
    ("eval-negative-temperature", EVAL + ["--out", "{ws}/ex", "--temperature", "-1"], ["--temperature"]),
    ("eval-depth-above-total", opts(EVAL, total_tokens="4", depth="6", out="{ws}/ex"),
     ["--depth 6", "--total-tokens 4"]),
    ("eval-device-tpu", EVAL + ["--out", "{ws}/ex", "--device", "tpu"], ["--device"]),
    ("eval-out-is-file", EVAL + ["--out", "{ws}/afile"], ["afile"]),
    ("report-corrupt-run-json", ["report", "{ws}/badrun", "--out", "{ws}/rx"],
     ["badrun/run.json", "not valid JSON", "line 2", "expected the run.json of `taps eval`"]),
    # study, averaging, profile, targets, tables
    ("reproduce-unknown-stage", ["reproduce", "{ws}/nostudy.yaml", "--stages", "evall"], ["evall"]),
    ("reproduce-missing-config", ["reproduce", "{ws}/nostudy.yaml", "--dry-run"], ["nostudy.yaml"]),
    ("average-same-name", ["average", "--drafter", "a={ws}/d", "--drafter", "a={ws}/d2", "--out", "{ws}/ax"],
     ["distinct", "a, a"]),
    ("average-out-is-file", AVG + ["--out", "{ws}/afile"], ["afile"]),
    ("average-missing-drafter", ["average", "--drafter", "{ws}/d", "--drafter", "{ws}/nodrafter", "--out", "{ws}/ax"],
     ["nodrafter"]),
    ("profile-repeats-0", ["profile", "--target", T, "--repeats", "0"], ["--repeats"]),
    ("target-convert-not-gguf", ["target", "convert", "{ws}/data.jsonl", "--out", "{ws}/cx"], ["data.jsonl"]),
    ("drafter-table-n-0", ["drafter", "table", "--target", T, "--drafters", "{ws}", "--data-dir", "{ws}",
                           "--out", "{ws}/tx", "--n", "0"], ["--n"]),
    ("unknown-command", ["evaluate"], ["evaluate"]),
    # outputs that would clobber: not a regular file, an input, another kind of result, a result without --force
    ("mix-out-is-fifo", MIX + ["messages:{ws}/data.jsonl", "--out", "{ws}/fifo"], ["--out {ws}/fifo", "a FIFO"]),
    ("mix-out-is-symlink", MIX + ["messages:{ws}/data.jsonl", "--out", "{ws}/link.jsonl"],
     ["--out {ws}/link.jsonl", "symbolic link"]),
    ("mix-out-is-its-source", ["data", "mix", "--source", "messages:{ws}/data.jsonl", "--out", "{ws}/data.jsonl"],
     ["--out {ws}/data.jsonl", "the input --source messages:{ws}/data.jsonl"]),
    ("mix-out-is-a-features-manifest", MIX + ["messages:{ws}/data.jsonl", "--out", "{ws}/feat/manifest.json"],
     ["--out {ws}/feat/manifest.json", "something else"]),
    ("mix-out-exists", MIX + ["messages:{ws}/data2.jsonl", "--out", "{ws}/mixed-before.jsonl"],
     ["--out {ws}/mixed-before.jsonl", "--force"]),
    ("drafter-init-over-a-drafter", ["drafter", "init", "--target", T, "--out", "{ws}/d", "--seed", "5"],
     ["--out {ws}/d", "holds a drafter", "--force"]),
    ("drafter-init-into-features", ["drafter", "init", "--target", T, "--out", "{ws}/feat"],
     ["--out {ws}/feat", "holds a features"]),
    ("train-over-a-drafter", TRAIN + ["--out", "{ws}/d2"], ["--out {ws}/d2", "--force"]),
    ("train-resume-over-a-drafter", TRAIN + ["--out", "{ws}/d2", "--resume"], ["--out {ws}/d2", "--force"]),
    ("train-into-eval-results", TRAIN + ["--out", "{ws}/results"], ["--out {ws}/results", "holds eval results"]),
    ("average-out-is-an-input", AVG + ["--out", "{ws}/d"], ["--out {ws}/d", "the input --drafter a={ws}/d"]),
    ("average-over-a-drafter", AVG + ["--out", "{ws}/run"], ["--out {ws}/run", "--force"]),
    ("average-into-a-datastore", AVG + ["--out", "{ws}/ds"], ["--out {ws}/ds", "holds a datastore"]),
    ("reduce-vocab-out-is-its-drafter", ["drafter", "reduce-vocab", "--drafter", "{ws}/d", "--features", "{ws}/feat",
                                         "--size", "10", "--out", "{ws}/d"], ["--out {ws}/d", "the input --drafter"]),
    ("regenerate-out-is-data", ["data", "regenerate", "--target", T, "--data", "{ws}/data.jsonl", "--out",
                                "{ws}/data.jsonl", "--device", "cpu"], ["--out {ws}/data.jsonl", "the input --data"]),
    ("features-into-eval-results", FEAT + ["--out", "{ws}/results"], ["--out {ws}/results", "holds eval results"]),
    ("features-into-a-drafter", FEAT + ["--out", "{ws}/d"], ["--out {ws}/d", "holds a drafter"]),
    ("eval-into-features", EVAL + ["--out", "{ws}/feat"], ["--out {ws}/feat", "holds a features"]),
    ("report-into-its-results", ["report", "{ws}/results", "--out", "{ws}/results"],
     ["--out {ws}/results", "RESULTS_DIR"]),
    ("drafter-table-out-is-a-features-manifest", ["drafter", "table", "--target", T, "--drafters", "{ws}/heads",
                                                  "--data-dir", "{ws}/bench", "--n", "1", "--temperatures", "0",
                                                  "--max-new-tokens", "2", "--out", "{ws}/feat/manifest"],
     ["--out {ws}/feat/manifest.json", "a drafter table"]),
    # numbers that parse but mean nothing
    ("generate-temperature-nan", GEN + ["--temperature", "nan"], ["--temperature", "nan"]),
    ("generate-temperature-inf", GEN + ["--temperature", "inf"], ["--temperature", "inf"]),
    ("generate-top-p-nan", GEN + ["--top-p", "nan"], ["--top-p", "nan"]),
    ("generate-seed-beyond-2-63", GEN + ["--seed", str(2 ** 80)], ["--seed", str(2 ** 80)]),
    ("eval-temperature-nan", EVAL + ["--out", "{ws}/ex", "--temperature", "0,nan"], ["--temperature", "0,nan"]),
    ("eval-temperature-inf", EVAL + ["--out", "{ws}/ex", "--temperature", "inf"], ["--temperature", "inf"]),
    ("train-lr-nan", TRAIN + ["--out", "{ws}/rx", "--lr", "nan"], ["--lr", "nan"]),
    ("regenerate-temperature-nan", ["data", "regenerate", "--target", T, "--data", "{ws}/data.jsonl", "--out",
                                    "{ws}/rg.jsonl", "--device", "cpu", "--temperature", "nan"],
     ["--temperature", "nan"]),
    # compositions, heads and datastores
    ("generate-route-empty-member", GEN + ["--variant", "route:{ws}/d,,{ws}/d2"],
     ["--variant route:{ws}/d,,{ws}/d2", "empty drafter"]),
    ("eval-merge-trailing-comma", EVAL + ["--out", "{ws}/ex", "--variant", "m=merge-trie:{ws}/d,{ws}/d2,"],
     ["--variant", "empty drafter"]),
    ("generate-head-nan-weights", GEN + ["--drafter", "{ws}/d-nan"],
     ["d-nan/model.safetensors", "fc.weight", "non-finite"]),
    ("average-head-nan-weights", ["average", "--drafter", "a={ws}/d", "--drafter", "b={ws}/d-nan", "--out",
                                  "{ws}/ax"], ["d-nan/model.safetensors", "non-finite"]),
    ("generate-datastore-changed-under-its-index", GEN + ["--drafter", "{ws}/ds-stale"],
     ["ds-stale/tokens.npy", "digest"]),
    # study configs: --dry-run checks what the run checks
    ("reproduce-temperature-nan", ["reproduce", "{ws}/nan-temperature.yaml", "--dry-run"],
     ["nan-temperature.yaml", "eval.temperatures"]),
    ("reproduce-limit-abc", ["reproduce", "{ws}/limit-abc.yaml", "--stages", "eval", "--no-progress"],
     ["limit-abc.yaml", "eval.limit", "'abc'"]),
    ("reproduce-dry-run-limit-abc", ["reproduce", "{ws}/limit-abc.yaml", "--dry-run"],
     ["limit-abc.yaml", "eval.limit", "'abc'"]),
    ("reproduce-dry-run-max-new-tokens-0", ["reproduce", "{ws}/max-new-tokens-0.yaml", "--dry-run"],
     ["max-new-tokens-0.yaml", "eval.max_new_tokens", "0"]),
    ("reproduce-seed-1e23", ["reproduce", "{ws}/seed-1e23.yaml", "--dry-run"], ["seed-1e23.yaml", "eval.seed", "1e23"]),
    ("reproduce-categories-string", ["reproduce", "{ws}/categories-string.yaml", "--dry-run"],
     ["categories-string.yaml", "eval.categories", "'writing'"]),
    ("reproduce-lambdas-string", ["reproduce", "{ws}/lambdas-string.yaml", "--dry-run"],
     ["lambdas-string.yaml", "lambdas", "'0.5'"]),
    ("reproduce-backbones-string", ["reproduce", "{ws}/backbones-string.yaml", "--dry-run"],
     ["backbones-string.yaml", "backbones", "'eagle2'"]),
    ("reproduce-duplicate-key", ["reproduce", "{ws}/duplicate-key.yaml", "--dry-run"],
     ["duplicate-key.yaml", "line 7", "'out'", "twice (first at line 2)"]),
    ("reproduce-binary-config", ["reproduce", "{ws}/binary.yaml", "--dry-run"], ["binary.yaml", "UTF-8"]),
    # servers: a malformed endpoint, a busy port
    ("regenerate-endpoint-models-malformed", ["data", "regenerate", "--endpoint", "{url}/bad-models", "--data",
                                              "{ws}/data.jsonl", "--out", "{ws}/rg.jsonl", "--retries", "0"],
     ["{url}/bad-models/v1/models", '{"data": "abc"}']),
    ("regenerate-endpoint-chat-malformed", ["data", "regenerate", "--endpoint", "{url}/bad-chat", "--data",
                                            "{ws}/data.jsonl", "--out", "{ws}/rg.jsonl", "--retries", "0"],
     ["{url}/bad-chat/v1/chat/completions", '{"choices": "abc"}']),
    ("serve-port-in-use", ["serve", "--target", T, "--port", "{port}", "--device", "cpu"],
     ["--port {port}", "in use"]),
]


def test_the_suite_is_large_enough():
    assert len(CASES) >= 110 and len({c[0] for c in CASES}) == len(CASES)


def fill(text: str, ws: Path, net: dict[str, str]) -> str:
    for key, value in {"{ws}": str(ws), **net}.items():
        text = text.replace(key, value)
    return text


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_exits_2_with_one_line_and_changes_nothing(case, ws, net, capsys):
    _, argv, culprits = case
    before = snapshot(ws)
    code, output = run_cli([fill(a, ws, net) for a in argv], capsys)
    assert code == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1, output
    for culprit in culprits:
        assert fill(culprit, ws, net) in errors[0], errors[0]
    assert snapshot(ws) == before  # earlier results byte-identical, nothing half-written beside them
    assert (ws / "fifo").is_fifo() and (ws / "link.jsonl").is_symlink()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_directory(ws, capsys, tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, output = run_cli([a.replace("{ws}", str(ws)) for a in opts(FEAT, out=str(locked / "f"))], capsys)
    finally:
        locked.chmod(0o755)
    assert code == 2 and "Traceback" not in output and str(locked) in output


def test_debug_shows_the_traceback(ws, capsys, monkeypatch):
    argv = ["generate", "--target", str(ws / "nope"), "--prompt", "hi"]
    with pytest.raises(FileNotFoundError):
        main(["--debug"] + argv)
    monkeypatch.setenv("TAPS_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(argv)


def test_a_real_bug_keeps_its_traceback(ws, capsys, monkeypatch):
    import taps.cli.main

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(taps.cli.main, "_drafter_init", broken)
    with pytest.raises(KeyError):
        main(["drafter", "init", "--target", str(ws / "tgt"), "--out", str(ws / "never")])


# ---- resuming what the code before run identities wrote -------------------------------------

def _strip(path: Path, keys) -> None:
    obj = json.loads(path.read_text())
    for key in keys:
        obj.pop(key)
    path.write_text(json.dumps(obj))


def test_resuming_directories_written_before_identities_were_recorded(ws, tmp_path, capsys):
    """Old manifests, run.json files and checkpoints lack the new keys: resumed with one warning
    line each, and the keys recorded from then on."""
    t = str(ws / "tgt")
    feat, results, run = tmp_path / "feat", tmp_path / "results", tmp_path / "run"
    for src, dst in ((ws / "feat", feat), (ws / "results", results), (ws / "run", run)):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".taps.lock"))
    _strip(feat / "manifest.json", ("target_weights", "target_dtype"))
    _strip(results / "run.json", ("target_weights", "target_dtype"))
    ckpt = sorted((run / "ckpt").glob("step-*"))[-1]
    state = json.loads((ckpt / "state.json").read_text())
    del state["extra"]["run_settings"]
    (ckpt / "state.json").write_text(json.dumps(state))

    assert main(["features", "--target", t, "--data", str(ws / "data.jsonl"), "--out", str(feat), "--dtype", "fp32",
                 "--device", "cpu", "--target-dtype", "float32"]) == 0
    assert "made before target_weights, target_dtype were recorded" in capsys.readouterr().err
    assert json.loads((feat / "manifest.json").read_text())["target_weights"].startswith("sha256:")

    eval_argv = [a.replace("{ws}", str(ws)) for a in EVAL] + ["--out", str(results)]
    assert main(eval_argv) == 0
    assert "were recorded" in capsys.readouterr().err
    assert "target_weights" in json.loads((results / "run.json").read_text())

    assert main([a.replace("{ws}", str(ws)) for a in opts(TRAIN, epochs="2", out=str(run))] + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "made before backbone" in err and "were recorded" in err
    latest = sorted((run / "ckpt").glob("step-*"))[-1]
    assert json.loads((latest / "state.json").read_text())["extra"]["run_settings"]["backbone"] == "eagle2"


# ---- one writer per output ------------------------------------------------------------------

def test_a_second_writer_is_refused_and_a_killed_one_leaves_no_lock(ws, tmp_path, capsys):
    out = tmp_path / "f"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from taps.core.outlock import acquire; "
                               f"acquire({str(out)!r}, 'features'); print('held', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["features", "--target", str(ws / "tgt"), "--data", str(ws / "data.jsonl"), "--out", str(out),
                "--dtype", "fp32", "--device", "cpu", "--target-dtype", "float32"]
        code, output = run_cli(argv, capsys)
        assert code == 2 and "Traceback" not in output
        assert f"{out}: another taps process (pid {holder.pid})" in output
        assert not (out / "manifest.json").exists()
    finally:
        holder.kill()  # SIGKILL: no cleanup runs in the holder
        holder.wait()
    time.sleep(0.1)
    assert main(argv) == 0  # the kernel dropped the dead holder's lock
    assert json.loads((out / "manifest.json").read_text())["complete"]


def test_two_writers_in_one_process_are_refused_too(tmp_path):
    from taps.core.outlock import OutputBusyError, output_lock

    with output_lock(tmp_path, "results"):
        with pytest.raises(OutputBusyError, match="another taps process"):
            with output_lock(tmp_path, "results"):
                pass
    with output_lock(tmp_path, "results"):  # released: free again
        pass



def test_settings_that_cannot_change_the_content_do_not_block_a_resume(ws, tmp_path, capsys):
    shutil.copytree(ws / "run", tmp_path / "run", ignore=shutil.ignore_patterns(".taps.lock"))
    train = [a.replace("{ws}", str(ws)) for a in opts(TRAIN, out=str(tmp_path / "run"))]
    assert main(train + ["--resume", "--checkpoint-steps", "1"]) == 0  # the checkpoint interval is not content
    feat = [a.replace("{ws}", str(ws)) for a in opts(FEAT, out=str(ws / "feat"))]
    before = snapshot(ws)
    assert main(feat + ["--records-per-shard", "3", "--tokens-per-batch", "64"]) == 0  # finished: only read
    eval_argv = [a.replace("{ws}", str(ws)) for a in opts(EVAL, out=str(ws / "results"))]
    eval_argv.remove("--no-progress")
    assert main(eval_argv) == 0  # with a progress bar this time: nothing left to decode
    assert snapshot(ws) == before


# ---- outputs: --force replaces a result, atomically --------------------------------------------

def test_force_replaces_a_result_and_leaves_nothing_beside_it(ws, tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    shutil.copy(ws / "mixed-before.jsonl", mixed)
    argv = ["data", "mix", "--source", f"messages:{ws / 'data2.jsonl'}", "--out", str(mixed)]
    assert run_cli(argv, capsys)[0] == 2
    assert main(argv + ["--force"]) == 0
    assert len(mixed.read_text().splitlines()) == 6  # data2's records replaced data's eight
    head = tmp_path / "d"
    shutil.copytree(ws / "d", head)
    before = (head / "model.safetensors").read_bytes()
    assert main(["drafter", "init", "--target", str(ws / "tgt"), "--out", str(head), "--seed", "9", "--force"]) == 0
    assert (head / "model.safetensors").read_bytes() != before
    assert main([a.replace("{ws}", str(ws)) for a in TRAIN] + ["--out", str(head), "--force"]) == 0
    assert (head / "ckpt").is_dir()
    assert sorted(p.name for p in tmp_path.rglob("*") if ".tmp" in p.name) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node takes root")
def test_a_device_is_never_written_over(ws, tmp_path, capsys):
    """As root, writing "into" /dev/full replaced the device with a regular file; a device node of
    our own (/dev/null's numbers) stands in for it here."""
    device = tmp_path / "full"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    for argv in (["data", "mix", "--source", f"messages:{ws / 'data.jsonl'}", "--out", str(device)],
                 ["data", "mix", "--source", f"messages:{ws / 'data.jsonl'}", "--out", str(device), "--force"]):
        code, output = run_cli(argv, capsys)
        assert code == 2 and f"--out {device}: a device" in output and "Traceback" not in output
    assert device.is_char_device()


# ---- leftovers: orphaned workers, resumed logs, a resume with nothing to resume ----------------

def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_workers_die_with_their_parent():
    """`eval --jobs` workers (taps.core.workers) of a parent killed with SIGKILL stop too: none goes on
    writing into results whose lock died with the parent."""
    parent = subprocess.Popen([sys.executable, "-c", "import time; from taps.core import workers; "
                               "procs = workers.start(time.sleep, [(300,), (300,)]); "
                               "print(*[p.pid for p in procs], flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pids = [int(p) for p in parent.stdout.readline().split()]
    try:
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60  # a liveness wait, not a speed figure: on the fix they go at once
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in pids)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_resume_cuts_the_metrics_log_back_to_its_checkpoint(ws, tmp_path):
    """Steps logged after the last checkpoint (a run killed between logging and checkpointing) are
    cut, so the resumed run logs each step once."""
    run = tmp_path / "run"
    train = [a.replace("{ws}", str(ws)) for a in TRAIN] + ["--out", str(run), "--checkpoint-steps", "1"]
    assert main(train) == 0
    log = run / "metrics.jsonl"
    once = log.read_text().splitlines()
    last = max(json.loads(line)["step"] for line in once)
    shutil.rmtree(run / "ckpt" / f"step-{last:06d}")  # killed after logging step `last`, before its checkpoint
    (run / "ckpt" / "latest").write_text(f"step-{last - 1:06d}\n")
    assert main(train + ["--resume"]) == 0
    again = log.read_text().splitlines()
    assert len(again) == len(once) and [json.loads(x)["step"] for x in again] == [json.loads(x)["step"] for x in once]


def test_a_resume_without_a_checkpoint_says_so(ws, tmp_path, capsys):
    out = tmp_path / "fresh"
    assert main([a.replace("{ws}", str(ws)) for a in TRAIN] + ["--out", str(out), "--resume"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "no checkpoint" in line]
    assert lines == [f"taps train: --resume: no checkpoint in {out / 'ckpt'}; starting from step 0"]
    assert (out / "model.safetensors").is_file()
