# Regenerates the kubelet DRA, DRA health and plugin-registration stubs from vgpu/dra/api/*.proto.
# Called by the top-level `make proto` as: $(MAKE) -f vgpu/dra/proto.mk BIN=.venv/bin
# OUT lets tests generate into a scratch tree and compare with the committed files.
BIN ?= .venv/bin
OUT ?= .
PROTOS := vgpu/dra/api/dra.proto vgpu/dra/api/registration.proto vgpu/dra/api/dra_health.proto

.PHONY: proto
proto:
	mkdir -p $(OUT)/vgpu/dra/api
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=$(OUT) --pyi_out=$(OUT) \
	  --grpc_python_out=$(OUT) $(PROTOS)
