import os

import torch

# Two cores: pin torch's intra-op threads so test timings do not depend on what else runs.
torch.set_num_threads(int(os.environ.get("TRACEFP4_TEST_THREADS", "2")))
