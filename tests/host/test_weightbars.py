"""Every weights progress bar vLLM prints, whichever loader reads the weights, is the load's weights phase with its
fraction: in the phase clock (the Gantt bar and the ETA) and in the log's progress (the page's phase and percent).

The lines are vLLM's own: tqdm with `_BAR_FORMAT = "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt}
[{elapsed}<{remaining}, {rate_fmt}]\\n"` and the `desc=` of each loader in
vllm/model_executor/model_loader/weight_utils.py (safetensors_weights_iterator, fastsafetensors_weights_iterator,
instanttensor_weights_iterator, pt_weights_iterator, multi_thread_pt_weights_iterator,
multi_thread_safetensors_weights_iterator, np_cache_weights_iterator, runai_safetensors_weights_iterator; the
bitsandbytes loader and the sharded-state loader with runai_streamer_sharded read through these)."""
import pytest

from deployments.host.loadphases import PhaseClock
from deployments.host.processlog import LoadProgress

# (the line, percent, done, total)
BARS = [
    ("Loading safetensors checkpoint shards:  50% Completed | 4/8 [18:00<18:00, 270.00s/it]", 50, 4, 8),
    ("Loading safetensors checkpoint shards (eager):  25% Completed | 2/8 [00:10<00:30,  5.00s/it]", 25, 2, 8),
    ("Loading safetensors using Fastsafetensor loader:  38% Completed | 3/8 [13:30<22:30, 270.00s/it]", 38, 3, 8),
    ("Loading safetensors using InstantTensor loader:  50% Completed | 600/1200 [00:30<00:30, 20.00it/s]",
     50, 600, 1200),
    ("Loading pt checkpoint shards:  50% Completed | 1/2 [00:05<00:05,  5.00s/it]", 50, 1, 2),
    ("Multi-thread loading pt checkpoint shards:  75% Completed | 3/4 [00:06<00:02,  2.00s/it]", 75, 3, 4),
    ("Multi-thread loading shards:  62% Completed | 5/8 [00:20<00:12,  4.00s/it]", 62, 5, 8),
    ("Loading np_cache checkpoint shards: 100% Completed | 2/2 [00:08<00:00,  4.00s/it]", 100, 2, 2),
    ("Loading safetensors using Runai Model Streamer:  37% Completed | 1110/3000 [00:40<01:08, 27.75it/s]",
     37, 1110, 3000),
    # Under Ray each worker's output comes with its name in front.
    ("(RayWorkerWrapper pid=4711) Loading safetensors using Fastsafetensor loader:  12% Completed | 1/8 "
     "[04:30<31:30, 270.00s/it]", 12, 1, 8),
    # tqdm starts each update with \r: updates the reader did not split come as one line, the last one counts.
    ("\rLoading safetensors using Fastsafetensor loader:   0% Completed | 0/8 [00:00<?, ?it/s]"
     "\rLoading safetensors using Fastsafetensor loader:  25% Completed | 2/8 [09:00<27:00, 270.00s/it]", 25, 2, 8),
]


@pytest.mark.parametrize("line, percent, done, total", BARS, ids=[b[0].strip()[:48] for b in BARS])
def test_a_loaders_bar_is_the_weights_phase_with_its_fraction(line, percent, done, total):
    clock = PhaseClock()
    clock.feed(line, 30.0)
    assert (clock.phase, clock.shards_done, clock.shards_total) == ("weights", done, total)

    progress = LoadProgress()
    progress.feed(line, now=30.0)
    assert (progress.phase, progress.shard_percent, progress.shards_done, progress.shards_total) == (
        "loading_weights", percent, done, total)
    assert progress.percent == 5 + 55 * percent // 100


def test_the_rate_of_a_fastsafetensors_load_gives_the_time_left():
    progress = LoadProgress()
    desc = "Loading safetensors using Fastsafetensor loader"
    progress.feed(f"{desc}:  12% Completed | 1/8 [04:30<31:30, 270.00s/it]", now=270.0)
    progress.feed(f"{desc}:  38% Completed | 3/8 [13:30<22:30, 270.00s/it]", now=810.0)
    assert progress.seconds_left == pytest.approx(5 * 270.0)


@pytest.mark.parametrize("line", [
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|█████     | 34/67 [00:03<00:03, 10.1it/s]",
    "Running batch:  50% Completed | 1/2 [00:01<00:01,  1.00it/s]",
    "Processed prompts:  50%|█████     | 1/2 [00:01<00:01,  1.00it/s]",
])
def test_other_bars_are_not_the_weights(line):
    clock, progress = PhaseClock(), LoadProgress()
    clock.feed(line, 5.0)
    progress.feed(line, now=5.0)
    assert clock.phase != "weights" and clock.shards_total == 0
    assert progress.phase != "loading_weights" and progress.shards_total == 0
