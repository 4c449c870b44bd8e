"""The prepared accelerator check runs here at a tiny shape (the real one needs a GPU or TPU): its
tables come out with a roofline fraction and an MFU when peaks are given, and stay honest ('?')
when the device's peaks are unknown."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--dtype", "float32", "--batches", "2", "--prompt", "16", "--new_tokens", "8",
        "--rows", "2", "--length", "128", "--steps", "1", "--repeats", "1"]


@pytest.mark.slow  # ~30 s of compiling two shapes; CI's slow pass runs it
def test_the_accelerator_check_prints_decode_against_its_roofline_and_learner_mfu():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accelerator_check.py"), *TINY,
                           "--peak_tflops", "1", "--peak_gbs", "10"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    decode = re.search(r"\| 2 \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|", done.stdout)
    assert decode, done.stdout
    rate, bound, fraction = (float(x.replace(",", "")) for x in decode.groups())
    assert rate > 0 and bound > 0 and abs(fraction - rate / bound) < 0.01
    learn = re.search(r"\| 2 x 128 \| ([\d,]+) \| ([\d.e+-]+) \|", done.stdout)
    assert learn and float(learn.group(1).replace(",", "")) > 0 and float(learn.group(2)) > 0, done.stdout
    assert "peaks: 1.0 TFLOP/s, 10.0 GB/s" in done.stdout
    memory = re.search(r"\| 2 x 128 \| ([\d,.]+) \| ([\d,.]+) \| ([\d.]+) \|", done.stdout)
    assert memory and 0.9 <= float(memory.group(3)) <= 1.1, done.stdout  # the plan against this backend's peak
    # The shell entry point names the real shape and keeps a log.
    script = (ROOT / "benchmarks" / "accelerator_check.sh").read_text()
    assert "--model 0.6b --dtype bfloat16" in script and "accelerator_check.out" in script
