"""The old name of `muster_launcher.integrations` (`from muster_frameworks import MusterHFCallback`)."""
import sys, muster_launcher.integrations; sys.modules[__name__] = muster_launcher.integrations
