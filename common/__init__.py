"""What client and server share: the order/sharding contract and the tensor wire format.

Pure NumPy and protobuf: no grpc, no DALI, no torch.
"""
