"""Drop-in nn.Module versions of the ops: same constructor arguments as torch.nn."""

import torch

from .softmax import log_softmax, softmax


class Softmax(torch.nn.Softmax):
    """torch.nn.Softmax running pintail.softmax."""

    def forward(self, input):
        return softmax(input, self.dim)


class LogSoftmax(torch.nn.LogSoftmax):
    """torch.nn.LogSoftmax running pintail.log_softmax."""

    def forward(self, input):
        return log_softmax(input, self.dim)
