package localcluster

import (
	"bufio"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// writeVerbs are the apiserver_request_total verbs that change stored state.
var writeVerbs = map[string]bool{"POST": true, "PUT": true, "PATCH": true, "DELETE": true, "DELETECOLLECTION": true, "APPLY": true}

// APIWrites reads a kube-apiserver's Prometheus text metrics and returns its write requests
// (apiserver_request_total with a write verb, any response code) summed per resource, keyed
// "resource.group" ("pods" for the core group, "pods/status" for a subresource). Diff two
// readings to count the writes in between.
func APIWrites(metrics io.Reader) (map[string]float64, error) {
	const metric = "apiserver_request_total{"
	out := map[string]float64{}
	sc := bufio.NewScanner(metrics)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, metric) {
			continue
		}
		end := strings.LastIndexByte(line, '}')
		if end < 0 {
			return nil, fmt.Errorf("apiserver_request_total: malformed line %q", line)
		}
		labels := parseLabels(line[len(metric):end])
		if !writeVerbs[labels["verb"]] {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(line[end+1:]), 64)
		if err != nil {
			return nil, fmt.Errorf("apiserver_request_total: value of %q: %w", line, err)
		}
		key := labels["resource"]
		if g := labels["group"]; g != "" {
			key += "." + g
		}
		if s := labels["subresource"]; s != "" {
			key += "/" + s
		}
		out[key] += v
	}
	return out, sc.Err()
}

// parseLabels splits `a="x",b="y"` (label values here hold no quotes or commas).
func parseLabels(s string) map[string]string {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if ok {
			out[k] = strings.Trim(v, `"`)
		}
	}
	return out
}

// DiffWrites is after minus before, per resource, leaving out resources with no writes between.
func DiffWrites(before, after map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for k, v := range after {
		if d := v - before[k]; d != 0 {
			out[k] = d
		}
	}
	return out
}
