"""The low-bit weight stack: the format and its code books (``formats``), packing per device
(``packing``), quantizers, the operand contract, the ops (``aipc::lowbit_linear`` and the planned CPU
op), the ``LowBitLinear`` module, the quantized output projection and the 2-bit quality gate."""
