"""A failed start explained from the engine's log (deployments/host/startcauses.py): one log tail per cause, the lines
as vLLM 0.32, torch, transformers and NCCL print them (their format strings rendered, with the process prefixes vLLM
puts before a worker's line). tests/e2e/test_startcauses_real.py renders the vLLM ones with the real engine's code."""
import pytest

from deployments.host import startcauses

CORE = "(EngineCore_DP0 pid=5812) ERROR 12-05 13:27:56 [core.py:1512] "
WORKER = "(EngineCore_DP0 pid=5812) (Worker_TP3 pid=5830) "
KV_HINT = (f"{WORKER}INFO 12-05 13:27:50 [gpu_worker.py:1034] Free memory on device (93.2/94.97 GiB) on startup. Desired GPU "
           "memory utilization is (0.92, 87.37 GiB). Actual usage is 71.25 GiB for consumed memory (weights + non-torch), "
           "3.10 GiB for peak activation, and 1.56 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with "
           "`--kv-cache-memory=12193035468` (11.36 GiB) to fit into requested memory, or `--kv-cache-memory=18092735068` "
           "(16.85 GiB) to fully utilize gpu memory. Current kv cache memory in use is 12.90 GiB.")
OOM = (f"{WORKER}ERROR 12-05 13:28:02 [multiproc_executor.py:772] torch.OutOfMemoryError: CUDA out of memory. Tried to "
       "allocate 2.00 GiB. GPU 3 has a total capacity of 94.97 GiB of which 1.02 GiB is free. Including non-PyTorch "
       "memory, this process has 93.93 GiB memory in use.")


def test_a_kv_cache_too_small_for_max_model_len_is_fixed_with_the_length_vllm_says_fits():
    tail = ["Traceback (most recent call last):",
            f"{CORE}ValueError: To serve at least one request with the model's max seq len (262144), (30.52 GiB KV cache "
            "is needed, which is larger than the available KV cache memory (11.44 GiB). Based on the available memory, "
            "the estimated maximum model length is 98160. Try increasing `gpu_memory_utilization` (which also controls "
            "CPU memory reservation on the CPU backend, despite its name) or decreasing `max_model_len` when "
            "initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."]
    cause = startcauses.advise(tail)
    assert (cause.kind, cause.fix) == ("kv_too_small", {"max-model-len": 98160})
    assert "262,144 tokens" in cause.sentence and "98,160 tokens fit" in cause.sentence
    assert cause.describe().endswith("Fix: --max-model-len 98160.")


def test_no_memory_for_any_kv_block_raises_utilization_by_a_step_up_to_a_ceiling():
    tail = [f"{CORE}ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its "
            "name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."]
    assert startcauses.advise(tail).fix == {"gpu-memory-utilization": 0.95}
    assert startcauses.advise(tail, {"gpu-memory-utilization": "0.8"}).fix == {"gpu-memory-utilization": 0.85}
    at_ceiling = startcauses.advise(tail, {"gpu-memory-utilization": 0.95})
    assert at_ceiling.fix == {} and "at its ceiling" in at_ceiling.sentence


def test_out_of_memory_takes_the_kv_cache_size_vllm_measured_when_it_logged_one():
    graphs = f"{WORKER}INFO 12-05 13:27:58 [gpu_model_runner.py:4412] Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 35%"
    cause = startcauses.advise([KV_HINT, graphs, OOM])
    assert (cause.kind, cause.fix) == ("cuda_oom", {"kv-cache-memory-bytes": 12193035468})
    assert "GPU 3 ran out of memory while capturing CUDA graphs (it asked for 2.00 GiB more)" in cause.sentence
    assert "11.36 GiB KV cache fits" in cause.sentence


def test_out_of_memory_without_a_measure_lowers_utilization_while_profiling():
    cause = startcauses.advise([OOM], {"gpu-memory-utilization": 0.92})
    assert cause.fix == {"gpu-memory-utilization": 0.87} and "while profiling memory" in cause.sentence
    hint_after = startcauses.advise([OOM, KV_HINT])  # a hint after the error is another start's, not this one's
    assert hint_after.fix == {"gpu-memory-utilization": 0.85}


@pytest.mark.parametrize(("line", "kind", "words"), [
    (f"{CORE}ValueError: Selected backend AttentionBackendEnum.FLASHINFER_MLA is not valid for this configuration. "
     "Reason: ['compute capability not supported']", "attention_backend", "FLASHINFER_MLA cannot run here"),
    (f"{CORE}ValueError: No valid attention backend found for cuda with AttentionSelectorConfig(head_size=576, "
     "dtype=torch.bfloat16, kv_cache_dtype='fp8'). Reasons: {FLASH_ATTN_MLA: [compute capability not supported]}.",
     "attention_backend", "No attention backend runs this model on cuda"),
    (f"{CORE}ModuleNotFoundError: No module named 'fastsafetensors'", "missing_package", "no fastsafetensors package"),
    (f"{CORE}ImportError: No module named 'runai_model_streamer.safetensors'", "missing_package", "no runai_model_streamer"),
    ("ValueError: The repository for /models/kimi contains custom code which must be executed to correctly load the "
     "model. You can inspect the repository content at /models/kimi. Please pass the argument `trust_remote_code=True` "
     "to allow custom code to be run.", "trust_remote_code", "--trust-remote-code"),
    (f"{WORKER}ERROR 12-05 13:27:41 [pynccl.py:110] RuntimeError: NCCL error: unhandled cuda error (run with "
     "NCCL_DEBUG=INFO for details)", "nccl", "NCCL_P2P_DISABLE=1"),
    ("torch.distributed.DistBackendError: Cuda failure 'peer access is not supported between these two devices'",
     "nccl", "host doctor"),
    ("OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 18771): address already in use",
     "port_taken", "choose another port"),
])
def test_each_other_cause_is_named_with_what_to_do_and_no_automatic_fix(line, kind, words):
    cause = startcauses.advise(["INFO 12-05 13:27:30 [api_server.py:1858] vLLM API server version 0.32.0", line])
    assert (cause.kind, cause.fix) == (kind, {}) and words in cause.sentence


def test_a_log_with_no_known_cause_says_nothing():
    """Words of a cause in lines that are not one: the engine's config (trust_remote_code=True), and vLLM retrying
    an internal port of its own."""
    assert startcauses.advise(["INFO 12-05 13:27:30 [api_server.py:1858] vLLM API server version 0.32.0",
                               "INFO 12-05 13:27:31 [core.py:93] Initializing a V1 LLM engine (v0.32.0) with config: "
                               "model='/models/kimi', trust_remote_code=True, dtype=torch.bfloat16",
                               "WARNING 12-05 13:27:32 [parallel.py:746] Address already in use. Retrying with a new port.",
                               f"{CORE}RuntimeError: Engine core initialization failed. See root cause above."]) is None
    assert startcauses.advise([]) is None
