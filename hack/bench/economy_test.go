package main

import (
	"strings"
	"testing"
)

func TestMetricsSum(t *testing.T) {
	m := parseMetrics(strings.NewReader(`# HELP ipwarden_controller_api_writes_total Writes.
# TYPE ipwarden_controller_api_writes_total counter
ipwarden_controller_api_writes_total{resource="ippools/status",result="ok",verb="update"} 4
ipwarden_controller_api_writes_total{resource="nodeipallocations/status",result="conflict",verb="update"} 1
ipwarden_controller_api_writes_total{resource="nodeipallocations/status",result="ok",verb="update"} 6
ipwarden_controller_api_writes_total_other 100
ipwarden_agent_ip_wait_seconds_bucket{le="0"} 0
ipwarden_agent_ip_wait_seconds_bucket{le="0.0005"} 7
ipwarden_agent_ip_wait_seconds_bucket{le="0.001"} 105
ipwarden_agent_spec_writes_total{result="ok"} NaNx
ipwarden_agent_spec_writes_total{result="error"} 2
`))
	for _, tc := range []struct {
		metric string
		labels []string
		want   float64
	}{
		{"ipwarden_controller_api_writes_total", nil, 11}, // not the _other metric sharing the prefix
		{"ipwarden_controller_api_writes_total", []string{`resource="nodeipallocations/status"`}, 7},
		{"ipwarden_controller_api_writes_total", []string{`resource="nodeipallocations/status"`, `result="ok"`}, 6},
		{"ipwarden_controller_api_writes_total", []string{`resource="pods"`}, 0},
		{"ipwarden_agent_ip_wait_seconds_bucket", []string{`le="0"`}, 0}, // not le="0.0005"
		{"ipwarden_agent_ip_wait_seconds_bucket", []string{`le="0.001"`}, 105},
		{"ipwarden_agent_spec_writes_total", nil, 2}, // the unparsable sample is left out
		{"missing", nil, 0},
	} {
		if got := m.sum(tc.metric, tc.labels...); got != tc.want {
			t.Errorf("sum(%s, %v) = %v, want %v", tc.metric, tc.labels, got, tc.want)
		}
	}
}

func TestRunStats(t *testing.T) {
	for _, tc := range []struct {
		runs []int
		mean float64
		p99  int
	}{
		{nil, 0, 0},
		{[]int{1}, 1, 1},
		{[]int{5, 1, 1, 1}, 2, 5}, // few samples: the p99 is the largest
		{append(make([]int, 98), 9), 9.0 / 99, 9},  // under 100 samples: the largest
		{append(make([]int, 99), 9), 9.0 / 100, 0}, // the 99th of 100
		{append(make([]int, 98), 9, 9), 0.18, 9},
	} {
		mean, p99 := runStats(tc.runs)
		if mean != tc.mean || p99 != tc.p99 {
			t.Errorf("runStats(%d runs) = %v, %d; want %v, %d", len(tc.runs), mean, p99, tc.mean, tc.p99)
		}
	}
}
