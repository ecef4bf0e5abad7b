# The whole "training script" of the launch benchmark: stamp the wall clock and print the rank in
# one write(2), before any import beyond os/time. With FAIL_ONCE=1, rank 1 of attempt 0 stamps
# its failure and exits 1 (restart latency).
import os, time
if os.environ.get("FAIL_ONCE") == "1" and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    os.write(1, f"FAIL t_ns={time.time_ns()}\n".encode())
    os._exit(1)
os.write(1, f"RANK={os.environ['RANK']} attempt={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} t_ns={time.time_ns()}\n".encode())
if os.environ.get("HOLD_S"):
    time.sleep(float(os.environ["HOLD_S"]))
