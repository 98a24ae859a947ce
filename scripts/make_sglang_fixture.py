"""Re-make fixtures/sglang_cpu_recording.{json,safetensors}: SGLang's Triton verify kernels,
interpreted on a CPU, driven through ddtree-lab's recorder (ddtree_lab.sglang_recorder.record_cpu_demo).

    python scripts/make_sglang_fixture.py
"""

from pathlib import Path

from ddtree_lab.sglang_recorder import record_cpu_demo, replay_recording

if __name__ == "__main__":
    out = Path(__file__).resolve().parent.parent / "fixtures" / "sglang_cpu_recording"
    recording = record_cpu_demo(out)
    for r in replay_recording(recording):
        print(r.step, r.row, r.request_id, r.kind, "same" if r.agrees else (r.differences or r.explanation))
    print("wrote", out.with_suffix(".json"), out.with_suffix(".safetensors"))
