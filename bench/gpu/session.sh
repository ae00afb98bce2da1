#!/usr/bin/env bash
# One device session's benchmarks, in order, detached from the device call that starts them (each
# call lasts at most 10 minutes; poll /tmp/results/progress from the next ones, with no gap over 30 s:
# an idle machine goes back, and its /tmp with it). On the GPU host, after ../shared/gpu/install.sh
# unpacked the bundle into /tmp/site and the tree was copied to /tmp/work:
#   cd /tmp/work && (setsid nohup bash bench/gpu/session.sh quick sbs32 profile bw dataset > /tmp/session.log 2>&1 &)
# Parts (minutes on an H200, engine starts included):
#   quick    bench/gpu/suite.sh quick: arena, capture and intervention tests (4)
#   capture  the arena writer's and the capture tests alone, engines without Inductor (~2.5)
#   sbs      bench_side_by_side, z engine, both workloads (6); sbs32: the 32-request one (3.5); SBS_ROUNDS (3)
#   sbs32copy bench_side_by_side, z beside z-copy (z copied after the attention op, as before 2026-12-04), 32
#            requests, and whether both capture the same rows (6); SBS_ROUNDS (5)
#   sbs512   bench_side_by_side, z engine, the 512-request workload alone (4); SBS_ROUNDS (3)
#   nographs bench_side_by_side, the z engine with arena_graphs off and forward_timing on, 32 requests: armed,
#            capture, armed after it, and after another process's GPU work (3.5)
#   reset    nographs' engine: which other GPU work ends the slow state after a capture; after an ablation (5)
#   start    nographs' engine: which captures (last_prompt, prompt, generated, all positions) start that state (5)
#   kick     nographs' engine: whether its own process (a second CUDA context) ends that state; captures beside
#            another process's kernels every 50 / 500 ms (5)
#   switch   nographs' engine beside the same with switch_context_every_s 0.05 and 0.02 (the engine ends the state
#            itself), four engines at 0.22 of the memory each, 32 requests (8)
#   pin      nographs with each engine core's step loop and the driver's event loop on a core of their own (3.5)
#   profile  bench.profile_step_loop for z-capture, z-ablate and bulk (3 x ~3; PROFILE_CASES picks, e.g. probes;
#            PROFILE_ARGS adds)
#   after    bench.profile_step_loop for z-armed, then z-armed after one z-capture batch (2 x ~3)
#   clocks   nvidia-smi samples the GPU's clocks, power and utilization every 250 ms from here on (clocks.csv)
#   bw       bench_bandwidth --via engine-inplace serve (6; BW_VIAS picks)
#   dataset  bench_dataset, one replica, cases a b c (8; DATASET_ARGS adds, e.g. "--cases a b --prompts 2048")
#   handle   bench_handle_path, bench_bandwidth's batch shape, no engine (2)
#   sink     bench_sink_source: shards from a touched buffer, a fresh arena-like mapping, pieces beside a busy
#            thread; then /dev/shm filled to 72 GB, batch by batch, twice (the first pass into memory the VM
#            has not touched lately, when it runs first on a fresh machine) (2.5)
#   pinned   bench/gpu/pinned_source.py: shards from a mapping registered (and filled by the GPU) elsewhere (0.5)
#   copies   bench/gpu/copy_paths.py: a bulk step's rows to host memory by kernel or copy engines (0.5)
#   state    bench/gpu/copy_state.py: which copy leaves a decode forward slower until another process's kernel;
#            needs torch alone, so it can also run before the bundle is installed (1.5)
#   stall    bench/gpu/register_stall.py: what registering arena memory costs a step loop (0.3)
#   staging  bench/gpu/staging_copies.py: an armed site's staging copies in a CUDA-graph decode step, on the step's
#            stream or a side stream; torch alone, like state (1)
#   sites    bench/gpu/site_costs.py: what armed and steerable sites (capserve's own Site) cost a compiled
#            8B-shaped step, per deployment (plain, lean, capture_all, steer_resid, default); needs the bundle (2)
#   ctxcost  bench/gpu/context_cost.py: switch_context_every_s's second context: device memory, creation, a launch's
#            host time; torch alone, like state (0.2)
#   q70      bench_quantized: Llama-3.1-70B shape in online fp8, plain vLLM then capserve with steer_layers at one
#            layer, then the defaults (one copy fits an H200), 32 x (512+256) and 128 x (512+128); Q_ROUNDS (3),
#            Q70_DEPLOYMENTS ("steer-layer default") (~14)
#   q8       bench_quantized: Llama-3.1-8B shape in online fp8, plain beside capserve's defaults and steer-layer,
#            512 x (512+128), side by side; Q_ROUNDS (3) (~9)
#   readouts bench_readouts: logit lens, 8 probes, probe-gated steering and a 16k-feature SAE read-out beside plain
#            vLLM, Llama-3.1-8B shape, both workloads, the lean deployment (R_DEPLOYMENT=default: the defaults); R_ROUNDS (3);
#            R_KV_GIB=16: both engines the same KV cache, not the same memory share (~8)
#   faults2  bench/gpu/faults.py with two replicas of the 8B shape on one GPU (replicas_per_gpu 2): replica kill,
#            engine kill, hang, redeploy (~15; FAULTS_ARGS="--faults redeploy": the last alone, ~5)
#   readiness bench/gpu/readiness.py: serve run cold, then warm from the same compile cache, tiny and the 8B
#            shape: seconds to /healthz, /readyz, a first reply; what a SIGINT leaves behind; the warm run times a
#            replacement of its killed replica (~8; READINESS_ARGS="--models tiny": ~5)
#   scaling2 bench_scaling, the 8B shape, one replica holding the GPU against two sharing it (replicas_per_gpu 2),
#            plain generate at 1x load (~7)
#   scaling2mps scaling2 under an MPS control daemon (started, then stopped), so that the two engines' kernels
#            run at once rather than taking turns; results in mps/ (~7)
#   moe      the architecture matrix's mixture-of-experts rows (Qwen3-MoE, Mixtral: router hooks under CUDA graphs),
#            engines without Inductor (~3)
# Copy /tmp/results/* to $OUT in each poll (bench/gpu/poll.sh), so a lost machine loses nothing already
# measured; issue the polls back to back, with nothing between them.
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
R=${RESULTS:-/tmp/results}; mkdir -p "$R"
SCALING2=(python3 -m bench.bench_scaling --config llama8b --replicas 1 2 --replicas-per-gpu 2 --cases generate --loads 1)
step() { echo "$(date +%T) start $1" >> "$R/progress"; shift; "$@"; echo "$(date +%T) rc=$?" >> "$R/progress"; }
for part in "$@"; do
  case $part in
    quick) step quick bash bench/gpu/suite.sh "$R" quick > "$R/quick.log" 2>&1 ;;
    capture) step capture env CAPSERVE_QUICK_GPU_ENGINES=1 python3 -m pytest tests/test_arena_writer.py tests/test_engine_capture.py \
               -q -p no:cacheprovider --junitxml="$R/gpu_suite_capture_quick.xml" > "$R/capture.log" 2>&1 ;;
    sbs) step sbs python3 -m bench.bench_side_by_side --config llama8b --deployments z --rounds ${SBS_ROUNDS:-3} --out "$R" > "$R/sbs.log" 2>&1 ;;
    sbs32) step sbs32 python3 -m bench.bench_side_by_side --config llama8b --deployments z --workloads 32x512+256 \
             --rounds ${SBS_ROUNDS:-3} --out "$R" > "$R/sbs32.log" 2>&1 ;;
    sbs32copy) step sbs32copy python3 -m bench.bench_side_by_side --config llama8b --deployments z z-copy --workloads 32x512+256 \
                 --rounds ${SBS_ROUNDS:-5} --out "$R" > "$R/sbs32copy.log" 2>&1 ;;
    sbs512) step sbs512 python3 -m bench.bench_side_by_side --config llama8b --deployments z --workloads 512x512+128 \
              --rounds ${SBS_ROUNDS:-3} --out "$R" > "$R/sbs512.log" 2>&1 ;;
    nographs) step nographs python3 -m bench.bench_side_by_side --config llama8b --deployments z-nographs \
                --workloads 32x512+256 --rounds 3 --out "$R" > "$R/nographs.log" 2>&1 ;;
    reset) step reset python3 -m bench.bench_side_by_side --config llama8b --deployments z-reset \
             --workloads 32x512+256 --rounds 3 --out "$R" > "$R/reset.log" 2>&1 ;;
    start) step start python3 -m bench.bench_side_by_side --config llama8b --deployments z-start \
             --workloads 32x512+256 --rounds 3 --out "$R" > "$R/start.log" 2>&1 ;;
    kick) step kick python3 -m bench.bench_side_by_side --config llama8b --deployments z-kick \
            --workloads 32x512+256 --rounds 3 --out "$R" > "$R/kick.log" 2>&1 ;;
    switch) step switch python3 -m bench.bench_side_by_side --config llama8b --deployments z-nographs z-switch z-switch-20ms \
              --memory-share 0.22 --workloads 32x512+256 --rounds 3 --out "$R" > "$R/switch.log" 2>&1 ;;
    pin) step pin python3 -m bench.bench_side_by_side --config llama8b --deployments z-nographs --pin \
           --workloads 32x512+256 --rounds 3 --out "$R" > "$R/pin.log" 2>&1 ;;
    profile) for case in ${PROFILE_CASES:-z-capture z-ablate bulk}; do
               step "profile $case" python3 -m bench.profile_step_loop --config llama8b --case $case ${PROFILE_ARGS:-} --out "$R" \
                 > "$R/profile_$case.log" 2>&1
             done ;;
    after) for after in "" z-capture; do
             step "profile z-armed after ${after:-nothing}" python3 -m bench.profile_step_loop --config llama8b --case z-armed \
               ${after:+--after $after} --out "$R" > "$R/profile_z-armed_after_${after:-nothing}.log" 2>&1
           done ;;
    clocks) nohup nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
              --format=csv -lms 250 > "$R/clocks.csv" 2>&1 &
            echo "$(date +%T) clocks sampled from here on" >> "$R/progress" ;;
    bw) step bw python3 -m bench.bench_bandwidth --config llama8b --via ${BW_VIAS:-engine-inplace serve} --out "$R" > "$R/bw.log" 2>&1 ;;
    dataset) step dataset python3 -m bench.bench_dataset --config llama8b --replicas 1 ${DATASET_ARGS:-} --out "$R" > "$R/dataset.log" 2>&1 ;;
    handle) step handle python3 -m bench.bench_handle_path --requests 32 --rows 527 --label llama8b_gpu_host --out "$R" \
              > "$R/handle.log" 2>&1 ;;
    sink) step sink python3 -m bench.bench_sink_source --gb 8 --threads 4 --fill-gb 72 --fill-passes 2 --label h200 --out "$R" > "$R/sink.log" 2>&1 ;;
    pinned) step pinned python3 bench/gpu/pinned_source.py --out "$R" > "$R/pinned.log" 2>&1 ;;
    copies) step copies python3 bench/gpu/copy_paths.py --out "$R" > "$R/copies.log" 2>&1 ;;
    state) step state python3 bench/gpu/copy_state.py --out "$R" > "$R/state.log" 2>&1 ;;
    stall) step stall python3 bench/gpu/register_stall.py --out "$R" > "$R/stall.log" 2>&1 ;;
    staging) step staging python3 bench/gpu/staging_copies.py --out "$R" > "$R/staging.log" 2>&1 ;;
    sites) step sites python3 bench/gpu/site_costs.py --out "$R" > "$R/sites.log" 2>&1 ;;
    ctxcost) step ctxcost python3 bench/gpu/context_cost.py --out "$R" > "$R/ctxcost.log" 2>&1 ;;
    q70) step q70 python3 -m bench.bench_quantized --config llama70b --quantization fp8 --sequential --max-num-seqs 256 \
           --deployments ${Q70_DEPLOYMENTS:-steer-layer default} \
           --workloads 32x512+256 128x512+128 --rounds ${Q_ROUNDS:-3} --out "$R" > "$R/q70.log" 2>&1 ;;
    q8) step q8 python3 -m bench.bench_quantized --config llama8b --quantization fp8 --deployments default steer-layer \
          --workloads 512x512+128 --rounds ${Q_ROUNDS:-3} --out "$R" > "$R/q8.log" 2>&1 ;;
    readouts) step readouts python3 -m bench.bench_readouts --config llama8b --rounds ${R_ROUNDS:-3} --deployment ${R_DEPLOYMENT:-lean} \
                ${R_KV_GIB:+--kv-cache-gib $R_KV_GIB} --out "$R" > "$R/readouts.log" 2>&1 ;;
    faults2) step faults2 python3 -m bench.gpu.faults --config llama8b --replicas-per-gpu 2 ${FAULTS_ARGS:-} --out "$R" > "$R/faults2.log" 2>&1 ;;
    readiness) step readiness python3 -m bench.gpu.readiness ${READINESS_ARGS:-} --out "$R" > "$R/readiness.log" 2>&1 ;;
    scaling2) step scaling2 "${SCALING2[@]}" --out "$R" > "$R/scaling2.log" 2>&1 ;;
    scaling2mps) step scaling2mps bash -c 'nvidia-cuda-mps-control -d || exit 5
                   "$@"; rc=$?; echo quit | nvidia-cuda-mps-control; exit $rc' _ "${SCALING2[@]}" --out "$R/mps" \
                   > "$R/scaling2mps.log" 2>&1 ;;
    moe) step moe env CAPSERVE_QUICK_GPU_ENGINES=1 python3 -m pytest tests/test_architectures.py -k "qwen3_moe or mixtral" \
           -q -p no:cacheprovider --junitxml="$R/gpu_suite_moe.xml" > "$R/moe.log" 2>&1 ;;
    *) echo "unknown part $part" >> "$R/progress" ;;
  esac
done
echo ALLDONE >> "$R/progress"
