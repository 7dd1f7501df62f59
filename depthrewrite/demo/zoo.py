"""``depthrewrite.demo.zoo`` is :mod:`depthrewrite.zoo` (the models from small configs and the CLI's model specs),
under the name it had when it lived in the demo package: the same module object, so its names and monkeypatching
are shared."""

import sys

from .. import zoo

sys.modules[__name__] = zoo
