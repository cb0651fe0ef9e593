"""caption-rl: CapRL++ caption RL on Accelerate (placeholder until the app lands)."""

import sys

if __name__ == "__main__":
    print("caption-rl is not implemented yet: see the status table in README.md.", file=sys.stderr)
    sys.exit(0)
