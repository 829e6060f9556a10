# Regenerates the kubelet device-plugin stubs from vgpu/deviceplugin/api/api.proto.
# Called by the top-level `make proto` as: $(MAKE) -f vgpu/deviceplugin/proto.mk BIN=.venv/bin
# OUT lets tests generate into a scratch tree and compare with the committed files.
BIN ?= .venv/bin
OUT ?= .
PROTO := vgpu/deviceplugin/api/api.proto

.PHONY: proto
proto:
	mkdir -p $(OUT)/vgpu/deviceplugin/api
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=$(OUT) --pyi_out=$(OUT) \
	  --grpc_python_out=$(OUT) $(PROTO)
