"""`config_lib.enable_compilation_cache`: the folder from the config or JAX_COMPILATION_CACHE_DIR,
and the same store threshold either way (unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS is set)."""

import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from jaxrl_agent import config_lib
from tests import conftest


@pytest.fixture
def restore_jax_cache_config():
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 7.0)  # not what the function sets
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def config(folder):
    c = ml_collections.ConfigDict()
    c.compilation_cache_dir = folder
    return c


def test_config_folder_and_threshold(tmp_path, monkeypatch, restore_jax_cache_config):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    assert config_lib.enable_compilation_cache(config(str(tmp_path / "xla"))) == str(tmp_path / "xla")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == config_lib.MIN_CACHED_COMPILE_SECONDS


def test_environment_folder_wins_and_gets_the_same_threshold(tmp_path, monkeypatch, restore_jax_cache_config):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    before = jax.config.jax_compilation_cache_dir
    assert config_lib.enable_compilation_cache(config(str(tmp_path / "xla"))) == str(tmp_path / "env")
    assert jax.config.jax_compilation_cache_dir == before  # JAX read the variable itself; not overridden
    assert jax.config.jax_persistent_cache_min_compile_time_secs == config_lib.MIN_CACHED_COMPILE_SECONDS


def test_a_threshold_from_the_environment_is_left_alone(tmp_path, monkeypatch, restore_jax_cache_config):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "7.0")
    config_lib.enable_compilation_cache(config(""))
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 7.0


def test_off_without_a_folder(monkeypatch, restore_jax_cache_config):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    assert config_lib.enable_compilation_cache(config("")) is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 7.0



def test_the_suite_compiles_unoptimised_unless_the_user_set_xla_flags():
    """tests/conftest.py's choice: with XLA_FLAGS unset (or set by conftest itself, as pytest-xdist's
    workers inherit it) the test process starts its backend with optimisation off and the processes
    it starts inherit the device count alone; flags the user set are used as they are, everywhere."""
    default, unoptimised = conftest.DEFAULT_XLA_FLAGS, conftest.UNOPTIMISED_FLAG
    for environ in ({}, {"XLA_FLAGS": default, conftest.DEFAULTED: "1"}):
        assert conftest.xla_flags_for_the_suite(environ) == (f"{default} {unoptimised}", default, True)
    users = "--xla_force_host_platform_device_count=2"
    assert conftest.xla_flags_for_the_suite({"XLA_FLAGS": users}) == (users, users, False)
    assert conftest.xla_flags_for_the_suite({"XLA_FLAGS": ""}) == ("", "", False)


def test_this_process_caches_apart_and_the_processes_it_starts_get_the_users_flags():
    """The choice as this run made it: this process's programs in a cache folder of their own when
    unoptimised, and a started process's XLA_FLAGS without the level (they compile, measure host
    choices and cache as a user's runs do)."""
    assert jax.config.jax_compilation_cache_dir == conftest.PROCESS_CACHE_DIR
    assert conftest.PROCESS_CACHE_DIR.endswith(os.sep + "backend_optimization_level_0") == conftest.UNOPTIMISED
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['XLA_FLAGS'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert child == conftest.CHILD_XLA_FLAGS
    if conftest.UNOPTIMISED:
        assert child == conftest.DEFAULT_XLA_FLAGS
