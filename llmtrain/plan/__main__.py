import sys

from llmtrain.plan.report import main

sys.exit(main())
