"""Generated protobuf and gRPC modules of the batchwire.v1 protocol.

``batchwire_pb2`` / ``batchwire_pb2_grpc`` hold the service; ``datum_pb2`` holds
Caffe's ``Datum`` record. They are produced from the ``.proto`` files beside
them when the package is built.
"""
