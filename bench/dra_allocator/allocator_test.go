// The reduced case of bench/RESULTS.md: kube-scheduler's own structured allocator
// (k8s.io/dynamic-resource-allocation, the version the sandbox runs), without a cluster, on the
// slice, class and claim shapes bench/dra_shapes.py writes to $SHAPES (one <shape>.json each).
// It measures what the DRA plugin's Filter pays per node, and what its PreFilter pays per pod.
//
//	.venv/bin/python bench/dra_shapes.py /tmp/shapes && cd bench/dra_allocator &&
//	SHAPES=/tmp/shapes GOFLAGS=-mod=mod GOPROXY=off go test -bench . -benchtime 3000x
package draallocator

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
)

const nodes = 1000

type shape struct {
	Slice resourceapi.ResourceSlice `json:"slice"`
	Class resourceapi.DeviceClass   `json:"class"`
	Claim resourceapi.ResourceClaim `json:"claim"`
}

type classes map[string]*resourceapi.DeviceClass

func (c classes) List() ([]*resourceapi.DeviceClass, error) {
	out := []*resourceapi.DeviceClass{}
	for _, v := range c {
		out = append(out, v)
	}
	return out, nil
}

func (c classes) Get(name string) (*resourceapi.DeviceClass, error) {
	if v, ok := c[name]; ok {
		return v, nil
	}
	return nil, fmt.Errorf("no class %s", name)
}

// kube-scheduler 1.36's defaults: everything but list-type attributes, so the "incubating" allocator.
var features = structured.Features{
	AdminAccess: true, ConsumableCapacity: true, DeviceBindingAndStatus: true,
	DeviceTaints: true, PartitionableDevices: true, PrioritizedList: true,
}

func load(b *testing.B) map[string]shape {
	dir := os.Getenv("SHAPES")
	if dir == "" {
		b.Skip("SHAPES: the folder bench/dra_shapes.py wrote")
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	out := map[string]shape{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			b.Fatal(err)
		}
		var s shape
		if err := json.Unmarshal(data, &s); err != nil {
			b.Fatalf("%s: %v", f, err)
		}
		for i := range s.Claim.Spec.Devices.Requests { // the API server's defaulting
			if r := s.Claim.Spec.Devices.Requests[i].Exactly; r != nil && r.AllocationMode == "" {
				r.AllocationMode = resourceapi.DeviceAllocationModeExactCount
			}
		}
		out[strings.TrimSuffix(filepath.Base(f), ".json")] = s
	}
	return out
}

func cluster(s shape) ([]*resourceapi.ResourceSlice, []*v1.Node) {
	slices := make([]*resourceapi.ResourceSlice, nodes)
	ns := make([]*v1.Node, nodes)
	for i := range nodes {
		name := fmt.Sprintf("bench-%d", i)
		sl := s.Slice.DeepCopy()
		sl.Name = name + "-" + sl.Spec.Driver
		sl.Spec.NodeName = &name
		sl.Spec.Pool.Name = name
		slices[i] = sl
		ns[i] = &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	}
	return slices, ns
}

func state() structured.AllocatedState {
	return structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
}

// BenchmarkFilter: one Allocate per node (the DRA plugin's Filter), nodes taken in turn.
func BenchmarkFilter(b *testing.B) {
	shapes := load(b)
	names := make([]string, 0, len(shapes))
	for n := range shapes {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		s := shapes[name]
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			slices, ns := cluster(s)
			cache := cel.NewCache(10, cel.Features{EnableConsumableCapacity: true})
			lister := classes{s.Class.Name: &s.Class}
			alloc, err := structured.NewAllocator(ctx, features, state(), lister, slices, cache)
			if err != nil {
				b.Fatal(err)
			}
			claims := []*resourceapi.ResourceClaim{&s.Claim}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				got, err := alloc.Allocate(ctx, ns[i%nodes], claims)
				if err != nil || len(got) != 1 {
					b.Fatalf("node %d: %v, %d results", i%nodes, err, len(got))
				}
			}
		})
	}
}

// BenchmarkPreFilter: the allocator made once per pod over every node's slice.
func BenchmarkPreFilter(b *testing.B) {
	shapes := load(b)
	for name, s := range shapes {
		b.Run(name, func(b *testing.B) {
			slices, _ := cluster(s)
			cache := cel.NewCache(10, cel.Features{EnableConsumableCapacity: true})
			lister := classes{s.Class.Name: &s.Class}
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				if _, err := structured.NewAllocator(context.Background(), features, state(), lister, slices, cache); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
