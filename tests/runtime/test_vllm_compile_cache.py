"""Where vLLM's compiled model goes on a CPU (`vllm.compile_cache`): the pure decision. That a group's pods
put it on the model cache volume and the next group loads instead of compiling again is
tests/cluster/test_lws_group.py, on vLLM's real CPU engine."""

from __future__ import annotations

from carpool.runtime.vllm.compile_cache import compile_cache_env

ROOT = "/var/cache/carpool/vllm"


def test_on_a_cpu_the_aot_artifacts_are_off_and_inductors_cache_is_on_the_cache_volume() -> None:
    assert compile_cache_env({}, cpu=True, cache_root=ROOT) == {
        "VLLM_USE_AOT_COMPILE": "0",
        "TORCHINDUCTOR_CACHE_DIR": f"{ROOT}/torchinductor",
    }


def test_what_the_pods_environment_sets_is_kept() -> None:
    mine = {"VLLM_USE_AOT_COMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": "/scratch/inductor"}
    assert compile_cache_env(mine, cpu=True, cache_root=ROOT) == {}
    assert compile_cache_env({"VLLM_USE_AOT_COMPILE": "1"}, cpu=True, cache_root=ROOT) == {
        "TORCHINDUCTOR_CACHE_DIR": f"{ROOT}/torchinductor"
    }


def test_on_a_gpu_nothing_changes() -> None:
    assert compile_cache_env({}, cpu=False, cache_root=ROOT) == {}
