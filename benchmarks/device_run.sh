#!/usr/bin/env bash
# The one prepared GPU run (the GPU issue): the decoding benchmark, then the training benchmark, on one H200; the
# pass/fail `train` phase (short `train.py` runs through Accelerate's FSDP2 with one process, and --compile) on
# its own. Sized for one device command (600 s at most: install ~20 s + decoding <= DECODE_BUDGET + 60 s = 260 s +
# training benchmark <= BENCH_BUDGET + 60 s = 260 s), so that a session's 15 device minutes also cover the
# machine's start (under a minute on 2026-12-04) and a shorter second command. On 2026-12-04 a compiled decoding
# step took about 50 s to compile, a compiled training row 17-110 s.
#
# A session's 15 device minutes, in order (the machine's start, under a minute, included):
#   fetch here; run(command="bash benchmarks/device_run.sh", carry=[".whl"], timeout_s=540, kind="nvidia-h200")
#   (about 8.5 min); if 5 minutes remain: item 6 (Sinkhorn against Llama) or 7 (the Compressive targets) below,
#   whichever the first command left unmeasured, with BENCH_BUDGET=180 and timeout_s=270; give the machine
#   back. Name the H200: the device tool's first call otherwise starts an H100 (its default kind),
#   and the targets, the earlier runs and the code generated without a GPU (benchmarks/fake_cuda.py) are an H200's.
#   Ratios within one run hold on either; absolute figures (decoding tokens/s) do not compare across the two.
#
# 1. Here, on a machine with PyPI (the device has none), once: download the wheels the device image lacks
#    (the reference packages and their needs, transformers at our version, datasets / evaluate for the tests):
#        benchmarks/device_run.sh fetch            # -> .whl/ (14 MB; ignored by git through .gitignore)
# 2. On the device, through the session's device tool, carrying .whl:
#        run(command="bash benchmarks/device_run.sh", carry=[".whl"], timeout_s=600)
#    or one phase: `bash benchmarks/device_run.sh bench` (tests, train: likewise); DECODE_ROWS / BENCH_ROWS (regular
#    expressions on row ids) and DECODE_BUDGET / BENCH_BUDGET (seconds) narrow a rerun.
# 3. Not in `all` (it needs its own command): `bash benchmarks/device_run.sh recall`, long-range recall at GPU scale
#    (passkey at RECALL_LENGTH=4096 tokens, buckets of 64, hidden 256 x 4 layers; causal Sinkhorn with and without
#    the distance curriculum beside transformers' Llama; RECALL_STEPS=1000 each, RECALL_BUDGET=420 s in all):
#        run(command="bash benchmarks/device_run.sh recall", carry=[".whl"], timeout_s=480)
#    -> $OUT/recall.json, recall.png, recall.log (merge into docs/benchmarks/recall.json by copying its runs).
# 4. Whether compiled training steps wait on the host (their `busy_s` against the step time says it): the CUDA-graph
#    rows beside the compiled ones, about 60 s a row (merge the rows into docs/benchmarks/gpu.json by hand):
#        BENCH_BUDGET=240 BENCH_ROWS='^(sinkhorn/ours|llama/llama)/bf16/(compiled|graphs)/8x2048' \
#            bash benchmarks/device_run.sh bench
# 5. Regional compilation (`longrange train --compile`'s default: each decoder layer compiled alone) against the
#    whole model, first step and step time, rows `regional` beside `compiled` (on the CPU 2-5x shorter compiles,
#    steps as fast; docs/benchmarks.md):
#        BENCH_BUDGET=240 BENCH_ROWS='^(sinkhorn/ours|llama/llama|compressive/ours)/bf16/(compiled|regional)/8x2048' \
#            bash benchmarks/device_run.sh bench
# 6. The three Sinkhorn-against-Llama training targets compiled (0.8x at 2,048, 1x at 8,192, 1.5x at 32,768): ours
#    regionally compiled (the shorter compile) and Llama whole-model compiled at every bf16 shape, about 200 s:
#        BENCH_BUDGET=240 BENCH_ROWS='^(sinkhorn/ours/bf16/regional|llama/llama/bf16/compiled)/' \
#            bash benchmarks/device_run.sh bench
#    The default `bench` spends its budget on the eager rows and the first compiled ones (the 2026-12-04 run
#    reached three compiled rows), so a session with one command to spare gets more from this one. (Since
#    2026-12-05 a whole-model graph shares the padding-mask terms across layers and a regional one does not: about
#    5 kernels a layer; `sinkhorn/ours/bf16/compiled` in place of `regional` measures that, at about 50 s of
#    compilation a shape.)
# 7. The Compressive targets (>= 1.3x the reference in tf32 and bf16, at no more peak memory): ours trained a
#    segment at a time (the procedure whose memory meets the reference's) eager, with explicit attention (tf32), and
#    compiled by layer (3 graphs: no memory, memory, memory and compressed memory; on the CPU the same weights as
#    eager after 3 steps), beside the reference eager and compiled, about 300 s:
#        BENCH_BUDGET=240 BENCH_ROWS='^compressive/(by_segment(_explicit)?/[a-z0-9]+/(eager|regional)|reference)/' \
#            bash benchmarks/device_run.sh bench
# 8. Packed training batches on the GPU (documents in groups of similar length against one group, and a call's fixed
#    cost in tokens: longrange.packing.GROUP_COST is the CPU's 128; set a CUDA value from `call_cost_tokens`;
#    about 5 minutes on 2 CPU cores, not yet run on a GPU):
#        run(command="bash benchmarks/device_run.sh packing", carry=[".whl"], timeout_s=270)
#    -> $OUT/packing.json, packing.log (docs/benchmarks.md, "Packed batches").
# 9. A decoding step exported with its cache (`longrange.export.ExportableDecoder`, both models, Llama through
#    transformers' recipe beside them) on the GPU: each step against uncached forwards (tests/test_export.py's CUDA
#    cases, skipped without a device; about a minute, not yet run on a GPU):
#        run(command="bash benchmarks/device_run.sh export", carry=[".whl"], timeout_s=180)
#    -> $OUT/export.log.
# Results go to $OUT (bench.json with the decoding rows merged in, decode.json, bench.log, decode.log, train.log;
# they come back: copy bench.json to docs/benchmarks/gpu.json here).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
BENCH_BUDGET=${BENCH_BUDGET:-200}
DECODE_BUDGET=${DECODE_BUDGET:-200}
OUT=${OUT:-/tmp/device-run}
phases=${1:-all}  # one phase or several, comma-separated (decode,bench); all: decode,bench
# (`train` - FSDP2 and --compile checks - passed on 2026-12-04; run it again when train.py or the FSDP path change)
[ "$phases" = all ] && phases=decode,bench
wants() { [[ ",$phases," == *",$1,"* ]]; }

if [ "$phases" = fetch ]; then
    mkdir -p "$WHEELS"  # .whl/ is in .gitignore: it travels only when a run names it in `carry`
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    # pure-Python wheels; versions as installed here (setup.cfg's `bench` extra pins the references)
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$WHEELS" \
        sinkhorn-transformer==0.11.4 compressive-transformer-pytorch==0.4.0 mogrifier==0.0.5 \
        product-key-memory==0.3.0 axial-positional-embedding==0.3.12 local-attention==1.11.2 \
        hyper-connections==0.4.11 torch-einops-utils==0.2.0 colt5-attention==0.11.2 transformers==5.25.0 \
        datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19
fi

mkdir -p "$OUT" docs/benchmarks
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$PWD:/tmp/site"
else
    echo "no wheels under $WHEELS: using the installed packages (the reference rows will record import errors)"
    export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__)"
status=0

if wants train; then
    {
        common=(--max_steps 20 --eval_every 10 --eval_tokens 8192 --num_samples 1 --sample_tokens 16 --num_threads 0)
        # Accelerate's FSDP2 path (one process: the same code as on several GPUs, gathers and all)
        timeout 30 python3 -m accelerate.commands.launch --config_file configs/accelerate/fsdp.yaml \
            --num_processes 1 -m longrange train --model sinkhorn "${common[@]}" --output_dir /tmp/run-fsdp-sinkhorn
        echo "fsdp sinkhorn rc=$?"
        timeout 30 python3 -m accelerate.commands.launch --config_file configs/accelerate/fsdp.yaml \
            --num_processes 1 -m longrange train --model compressive "${common[@]}" --output_dir /tmp/run-fsdp-compressive
        echo "fsdp compressive rc=$?"
        # compiled training (inductor)
        timeout 90 python3 -m longrange train --model sinkhorn --compile "${common[@]}" --output_dir /tmp/run-compile
        echo "compile sinkhorn rc=$?"
    } 2>&1 | tee "$OUT/train.log"
    grep -q "rc=[1-9]" "$OUT/train.log" && status=1
fi

if wants decode; then
    # decoding tokens/s at 512 / 1,024 / 4,096 tokens of context (its rows go under "decoding" in gpu.json)
    # (TORCH_LOGS=recompiles: why a compiled decoding step compiled again, in decode.log)
    TORCH_LOGS=recompiles timeout $((DECODE_BUDGET + 60)) python3 benchmarks/benchmark_decoding.py --device cuda \
        --budget "$DECODE_BUDGET" --rows "${DECODE_ROWS:-.}" --out "$OUT/decode.json" --plot "$OUT/decoding.png" 2>&1 \
        | grep --line-buffered -v cudagraph_utils | tee "$OUT/decode.log" || status=1
fi

if wants bench; then
    # the benchmark stops starting rows after BENCH_BUDGET s and rewrites its JSON after every row
    timeout $((BENCH_BUDGET + 60)) python3 benchmarks/benchmark_gpu.py --device cuda --budget "$BENCH_BUDGET" \
        --rows "${BENCH_ROWS:-.}" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
# docs/benchmarks/gpu.json: the training rows with the decoding rows under "decoding"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
payload = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else {}
if (out / "decode.json").exists():
    payload["decoding"] = json.loads((out / "decode.json").read_text())["decoding"]
if payload:
    (out / "bench.json").write_text(json.dumps(payload, indent=1) + "\n")
    pathlib.Path("docs/benchmarks/gpu.json").write_text(json.dumps(payload, indent=1) + "\n")
PY

if wants tests; then
    # the default suite (CPU tests: longer than one device command; run it only when a session has minutes to spare)
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log" || status=1
fi

if wants export; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_export.py -k cuda 2>&1 \
        | tee "$OUT/export.log" || status=1
fi

if wants recall; then
    recall=(benchmarks/benchmark_recall.py --family sinkhorn --length "${RECALL_LENGTH:-4096}" --bucket 64
        --hidden 256 --layers 4 --heads 4 --batch 16 --steps "${RECALL_STEPS:-1000}" --eval-sequences 256
        --seeds 0 --threads 0 --device cuda --no-progress --json "$OUT/recall.json" --plot "$OUT/recall.png")
    # the defaults, the retrieval options (weight_routed_values=False, axial_position_embeddings=False), Llama
    timeout "${RECALL_BUDGET:-420}" python3 "${recall[@]}" --models llama top2_unweighted_rowpos top2 2>&1 \
        | tee "$OUT/recall.log" || status=1
fi

if wants packing; then
    # packed training batches in groups against one group, and a call's cost in tokens on the GPU (GROUP_COST)
    timeout 240 python3 benchmarks/benchmark_packing.py --device cuda --calibrate --json "$OUT/packing.json" 2>&1 \
        | tee "$OUT/packing.log" || status=1
fi

exit $status
