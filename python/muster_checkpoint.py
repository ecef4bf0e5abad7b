"""The old name of `muster_launcher.checkpoint` (scripts `import muster_checkpoint`): the same module."""
import sys, muster_launcher.checkpoint; sys.modules[__name__] = muster_launcher.checkpoint
