// Command promcheck parses Prometheus alerting/recording rule files (rulefmt: the format
// promtool checks, PromQL included) and Grafana dashboards (every target's expr, with Grafana's
// variables substituted, through the PromQL parser), and prints the metric names they use, one a
// line. It exits non-zero with the problems when a file does not parse. Its own module keeps the
// Prometheus server module's dependencies out of ipwarden's.
//
//	promcheck rules FILE... | dashboard FILE...
package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"sort"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

func main() {
	if len(os.Args) < 3 || (os.Args[1] != "rules" && os.Args[1] != "dashboard") {
		fmt.Fprintln(os.Stderr, "usage: promcheck rules FILE... | dashboard FILE...")
		os.Exit(2)
	}
	names := map[string]bool{}
	failed := false
	for _, f := range os.Args[2:] {
		var exprs []string
		var err error
		if os.Args[1] == "rules" {
			exprs, err = ruleExprs(f)
		} else {
			exprs, err = dashboardExprs(f)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", f, err)
			failed = true
			continue
		}
		for _, e := range exprs {
			if err := metricNames(e, names); err != nil {
				fmt.Fprintf(os.Stderr, "%s: %q: %v\n", f, e, err)
				failed = true
			}
		}
	}
	if failed {
		os.Exit(1)
	}
	out := make([]string, 0, len(names))
	for n := range names {
		out = append(out, n)
	}
	sort.Strings(out)
	for _, n := range out {
		fmt.Println(n)
	}
}

func ruleExprs(path string) ([]string, error) {
	groups, errs := rulefmt.ParseFile(path, false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	if len(errs) > 0 {
		return nil, fmt.Errorf("%v", errs)
	}
	var out []string
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			out = append(out, r.Expr)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no rules")
	}
	return out, nil
}

// promql is Prometheus' default PromQL parser (the functions Prometheus ships).
var promql = parser.NewParser(parser.Options{})

// grafanaVars are Grafana's template variables: $__rate_interval and friends become a range,
// others ($pool, ${node}) a label value.
var (
	rangeVar = regexp.MustCompile(`\$__(rate_)?interval|\$__range`)
	otherVar = regexp.MustCompile(`\$\{?[A-Za-z_][A-Za-z0-9_]*(:[a-z]+)?\}?`)
)

func dashboardExprs(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d struct {
		Panels []panel `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		return nil, err
	}
	var out []string
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, t := range p.Targets {
				e := rangeVar.ReplaceAllString(t.Expr, "5m")
				e = otherVar.ReplaceAllString(e, "x")
				out = append(out, e)
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	if len(out) == 0 {
		return nil, fmt.Errorf("no panel targets")
	}
	return out, nil
}

type panel struct {
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"`
}

// metricNames adds the metric names an expression selects.
func metricNames(expr string, names map[string]bool) error {
	e, err := promql.ParseExpr(expr)
	if err != nil {
		return err
	}
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			if vs.Name != "" {
				names[vs.Name] = true
			}
		}
		return nil
	})
	return nil
}
