"""Redraws one progress line ten times a second, the way tqdm does, then ends it."""

import sys
import time

STEPS = 80
for step in range(STEPS + 1):
    sys.stdout.write(f"\rprogress {step}/{STEPS} |{'#' * (step // 8):<10}|")
    sys.stdout.flush()
    time.sleep(0.1)
sys.stdout.write("\n")
print("progress bar done", flush=True)
