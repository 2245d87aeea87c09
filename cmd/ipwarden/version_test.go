package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestVersionCommand(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		check   func(string) bool
		wantErr string
	}{
		{args: []string{"version"}, check: func(s string) bool { return strings.HasPrefix(s, "ipwarden dev") }},
		{args: []string{"version", "-o", "json"}, check: func(s string) bool {
			var v map[string]any
			return json.Unmarshal([]byte(s), &v) == nil && v["version"] == "dev"
		}},
		{args: []string{"version", "-o", "yaml"}, wantErr: `unknown output format "yaml"`},
		{args: []string{"version", "extra"}, wantErr: "unknown command"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			root := newRootCommand()
			var out bytes.Buffer
			root.SetOut(&out)
			root.SetErr(&out)
			root.SetArgs(tc.args)
			err := root.Execute()
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error = %v, want containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tc.check(out.String()) {
				t.Fatalf("unexpected output %q", out.String())
			}
		})
	}
}
